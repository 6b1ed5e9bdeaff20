//! Hibernate a conversation, exit, and resume it in a new process on a smaller rung.
//!
//! ```sh
//! cargo run --release --example hibernate -- save qwen2.5-coder /tmp/chat.molt-state
//! cargo run --release --example hibernate -- resume qwen2.5-coder /tmp/chat.molt-state tier2
//! ```
//!
//! `save` answers one message and writes the conversation (its KV cache, its messages, the rung
//! it is on) to the file. `resume` puts it back on the rung named (default: the smallest),
//! carrying the cache through the switch without loading the rung that wrote it, and asks
//! about the first turn.

use molt::Molt;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mode, ladder, file) = match args.as_slice() {
        [m, l, f, ..] => (m.as_str(), l.as_str(), f.as_str()),
        _ => return Err("usage: hibernate save|resume LADDER FILE [RUNG]".into()),
    };
    match mode {
        "save" => {
            let molt = Molt::builder(ladder).build()?;
            let mut chat = molt.conversation();
            chat.set_max_tokens(32);
            let stats = chat.ask("Remember this: the staging database listens on port 6142.")?;
            println!("[{}] {}", stats.rungs_used.join(","), stats.text.trim());
            let bytes = chat.hibernate(file)?;
            println!(
                "hibernated on {} to {file} ({bytes} bytes)",
                molt.current_rung()?
            );
        }
        "resume" => {
            // Only the rung it resumes on is loaded: the file's cache is carried onto it.
            let (estimate, builder) = Molt::builder(ladder).estimate()?;
            let rung = args
                .get(3)
                .cloned()
                .or_else(|| estimate.rungs.last().map(|r| r.rung.clone()))
                .ok_or("the ladder has no rungs")?;
            let molt = builder.start_on(&rung).build()?;
            let mut chat = molt.resume(file, Some(&rung))?;
            println!("resumed on {}", molt.current_rung()?);
            chat.set_max_tokens(32);
            let stats = chat.ask("Which port does the staging database listen on?")?;
            println!("[{}] {}", stats.rungs_used.join(","), stats.text.trim());
            println!(
                "{} prompt tokens, {} of them cached",
                stats.prompt_tokens, stats.cached_tokens
            );
        }
        other => return Err(format!("unknown mode {other}: save or resume").into()),
    }
    Ok(())
}
