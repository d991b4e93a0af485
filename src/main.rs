//! The `outbox-streamer` command line.

// Only `outbox-kafka`'s queue_events.rs may use `unsafe` (the workspace denies it; this crate
// forbids it outright).
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use outbox_streamer::cli::{Cli, execute};

fn main() -> ExitCode {
    quiet_on_closed_stdout();
    outbox_streamer::tls::install_crypto_provider();
    let cli = Cli::parse();
    outbox_streamer::cli::init_logging(cli.log_format, &cli.command);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(execute(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `outbox-streamer setup --dry-run | head` closes stdout early; `println!` then panics. End
/// quietly instead, as a filter would on SIGPIPE (Rust ignores that signal).
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if message.starts_with("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}
