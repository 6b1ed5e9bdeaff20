//! Stream one answer under the machine's real memory pressure: every token is printed with the
//! rung that produced it, and every switch between two tokens as a line of its own.
//!
//! ```sh
//! cargo run --release --example stream -- qwen2.5-coder "Explain what a KV cache is."
//! ```
//!
//! The first argument is a ladder (a name, or the path of its manifest), the second the
//! message. Start something memory-hungry while it answers and watch it move.

use molt::{Budget, Event, Molt};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let ladder = args.next().unwrap_or_else(|| "qwen2.5-coder".to_string());
    let message = args
        .next()
        .unwrap_or_else(|| "Explain what a KV cache is.".to_string());

    let molt = Molt::builder(ladder.as_str())
        .budget(Budget::system())
        .on_progress(|p| eprintln!("{p:?}"))
        .build()?;
    let mut chat = molt.conversation();
    chat.set_max_tokens(96);

    let mut rung = String::new();
    for event in chat.send(&message)? {
        match event? {
            Event::Token { text, rung: r, .. } => {
                if r != rung {
                    print!("\n[{r}] ");
                    rung = r;
                }
                print!("{text}");
            }
            Event::Switch(s) => println!(
                "\n↘ {} → {} ({:?}) in {:.0} ms",
                s.from, s.to, s.method, s.timings.cost_ms
            ),
            Event::Done(s) => println!(
                "\n— {} tokens, first after {:.0} ms, {} switch(es)",
                s.tokens,
                s.ttft_ms,
                s.switches.len()
            ),
            _ => {}
        }
    }
    Ok(())
}
