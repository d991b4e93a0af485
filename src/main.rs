//! The `outbox-streamer` command line.

use std::process::ExitCode;

use clap::Parser;
use outbox_streamer::cli::{Cli, execute};

fn main() -> ExitCode {
    let cli = Cli::parse();
    outbox_streamer::cli::init_logging(cli.log_format);
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
