use super::*;

#[test]
fn readme_block_is_replaced_between_its_markers() {
    let r = format!("intro\n{README_BEGIN}\nold figures\n{README_END}\nrest\n");
    let out = splice_readme(&r, "\n![hero](x.png)\n").unwrap().unwrap();
    assert_eq!(
        out,
        format!("intro\n{README_BEGIN}\n![hero](x.png)\n{README_END}\nrest\n")
    );
    // Idempotent: splicing the same block again changes nothing.
    assert_eq!(splice_readme(&out, "![hero](x.png)").unwrap().unwrap(), out);
    assert_eq!(splice_readme("no markers", "x").unwrap(), None);
    assert!(splice_readme(&format!("{README_BEGIN} no end"), "x").is_err());
    let twice = format!("{README_BEGIN}{README_END}{README_BEGIN}{README_END}");
    assert!(splice_readme(&twice, "x").is_err());
}
