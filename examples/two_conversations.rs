//! Two conversations under one budget, and a cut in the middle of an answer.
//!
//! ```sh
//! cargo run --release --example two_conversations -- qwen2.5-coder
//! ```
//!
//! Conversation A starts an answer on the largest rung; after a few tokens the application
//! cuts the budget to what only the smallest rung fits in (as it would on a platform memory
//! warning), and A's answer moves there between two tokens. Conversation B is then answered
//! under the same budget, and A goes on with a second turn: each keeps its own context.

use molt::{Budget, Event, Molt};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ladder = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "qwen2.5-coder".to_string());
    let (estimate, builder) = Molt::builder(ladder.as_str()).estimate()?;
    let [.., next, smallest] = estimate.rungs.as_slice() else {
        return Err("the ladder has fewer than two rungs".into());
    };
    // What only the smallest rung fits in: halfway between its footprint and the next one's.
    let cut = (smallest.full_window_bytes + next.full_window_bytes) / 2;
    let molt = builder.build()?;

    let mut a = molt.conversation();
    let mut b = molt.conversation();
    a.set_max_tokens(40);
    b.set_max_tokens(24);

    println!("A> My name is Ada and my build server is called falcon. What is a mutex?");
    let mut answer =
        a.send("My name is Ada and my build server is called falcon. What is a mutex?")?;
    for event in answer.by_ref() {
        match event? {
            Event::Token {
                index, text, rung, ..
            } => {
                print!("[{rung}]{text}");
                if index == 8 {
                    molt.set_budget(Budget::Bytes(cut))?;
                }
            }
            Event::Switch(s) => println!(
                "\n↘ budget cut to {} MiB: {} → {} ({:?}) in {:.0} ms",
                cut >> 20,
                s.from,
                s.to,
                s.method,
                s.timings.cost_ms
            ),
            _ => {}
        }
    }
    let stats = answer.finish()?;
    println!("\nA: {} tokens on {:?}", stats.tokens, stats.rungs_used);

    println!("B> Write a haiku about memory.");
    let stats = b.ask("Write a haiku about memory.")?;
    println!("[{}] {}", stats.rungs_used.join(","), stats.text.trim());

    println!("A> What is my build server called?");
    let stats = a.ask("What is my build server called?")?;
    println!("[{}] {}", stats.rungs_used.join(","), stats.text.trim());
    println!(
        "A's second turn: {} prompt tokens, {} of them cached",
        stats.prompt_tokens, stats.cached_tokens
    );
    Ok(())
}
