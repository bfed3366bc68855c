//! The `rcm` command: decode CM traffic now; bench, ping, stress and daemon to come.

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "rcm",
    version,
    about = "rcm: an RDMA connection manager in user space"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Decode RDMA CM traffic in a pcap/pcapng file: IB CM MADs over RoCEv2 (UDP 4791) and
    /// iWARP MPA over TCP, one line per message, every ICRC and MPA CRC verified.
    ///
    /// Exit status: 0 when every RoCEv2/MPA packet decoded and verified, 1 when any was
    /// corrupt (reported with error=...), 2 when the file could not be read.
    Decode {
        /// The capture file (pcap or pcapng; Ethernet, Linux cooked, raw IP or loopback).
        file: PathBuf,
        /// Print every field of every message under its line.
        #[arg(short, long)]
        verbose: bool,
        /// One JSON object per line (all fields included) instead of text.
        #[arg(long, conflicts_with = "verbose")]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Decode {
            file,
            verbose,
            json,
        } => decode(&file, verbose, json),
    }
}

fn decode(file: &std::path::Path, verbose: bool, json: bool) -> ExitCode {
    let (records, totals, warning) = match rcm_cli::decode::decode_file(file) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("rcm decode: {e}");
            return ExitCode::from(2);
        }
    };
    let mut out = String::new();
    for r in &records {
        if json {
            let mut r = r.clone();
            if r.detail.is_none() {
                r.detail = Some(serde_json::Value::Null);
            }
            out.push_str(&serde_json::to_string(&r).unwrap_or_default());
            out.push('\n');
        } else {
            out.push_str(&r.line());
            out.push('\n');
            if verbose {
                if let Some(d) = &r.detail {
                    for l in rcm_cli::decode::verbose_lines(d) {
                        out.push_str("        ");
                        out.push_str(&l);
                        out.push('\n');
                    }
                }
            }
        }
    }
    print!("{out}");
    if let Some(w) = warning {
        eprintln!("rcm decode: warning: {w}");
    }
    eprintln!(
        "rcm decode: {} frames, {} messages, {} corrupt, {} other frames skipped",
        totals.frames, totals.records, totals.errors, totals.skipped
    );
    if totals.errors > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
