//! `plug_gate`: hag's output gate (`hagctl/src/plug.rs`) driven by hand,
//! the test hook of the `output_plug` scenario. Not part of hagctl's
//! interface.
//!
//! ```text
//! plug_gate IFNAME [LIMIT-BYTES]   attach a plug to IFNAME, then obey stdin
//! plug_gate --selfcheck            the plug on lo of a fresh network namespace
//! plug_gate --selfcheck-here       the same on this namespace's own lo
//! ```
//!
//! After attaching it prints `ok attach <counters>` and reads one command a
//! line from stdin: `buffer`, `release-one`, `release-indefinite`,
//! `limit BYTES`, `stats`, `detach` (ends), `exit` (ends, leaving the plug
//! holding, as a hagctl that dies would). Each is answered by one line,
//! `ok CMD <counters>` or `error CMD: <what>`. End of input is `exit`.
//! Exit status 0, or 1 if attaching failed (after `error attach: ...`).

#[path = "../src/plug.rs"]
mod plug;

use std::io::BufRead;
use std::process::ExitCode;

use plug::{describe as chain, Plug};

fn counters(gate: &mut Plug) -> String {
    match gate.stats() {
        Ok(s) => s.to_string(),
        Err(e) => format!("(no counters: {})", chain(&e)),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let selfcheck = match args.first().map(String::as_str) {
        Some("--selfcheck") => Some(plug::selfcheck::on_loopback as fn() -> _),
        Some("--selfcheck-here") => Some(plug::selfcheck::on_loopback_here as fn() -> _),
        _ => None,
    };
    if let Some(check) = selfcheck {
        return match check() {
            Ok(plug::selfcheck::Outcome::Passed(lines)) => {
                for l in lines {
                    println!("selfcheck: {l}");
                }
                println!("selfcheck: PASS");
                ExitCode::SUCCESS
            }
            Ok(plug::selfcheck::Outcome::Skipped(why)) => {
                println!("selfcheck: SKIPPED: {why}");
                ExitCode::from(2)
            }
            Err(e) => {
                println!("selfcheck: FAIL: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let (Some(ifname), 1..=2) = (args.first(), args.len()) else {
        eprintln!("usage: plug_gate IFNAME [LIMIT-BYTES] | plug_gate --selfcheck[-here]");
        return ExitCode::from(2);
    };
    let limit = match args.get(1).map(|l| l.parse::<u32>()) {
        None => plug::DEFAULT_LIMIT,
        Some(Ok(l)) => l,
        Some(Err(e)) => {
            eprintln!("plug_gate: limit {:?}: {e}", args[1]);
            return ExitCode::from(2);
        }
    };
    let mut gate = match Plug::attach_with_limit(ifname, limit) {
        Ok(g) => g,
        Err(e) => {
            println!("error attach: {}", chain(&e));
            return ExitCode::FAILURE;
        }
    };
    println!("ok attach {}", counters(&mut gate));
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        let done = match words.as_slice() {
            [] => continue,
            ["buffer"] => gate.buffer(),
            ["release-one"] => gate.release_one(),
            ["release-indefinite"] => gate.release_indefinite(),
            ["limit", n] => match n.parse() {
                Ok(n) => gate.set_limit(n),
                Err(e) => {
                    println!("error {line}: {e}");
                    continue;
                }
            },
            ["stats"] => Ok(()),
            ["detach"] => {
                match gate.detach() {
                    Ok(()) => println!("ok detach"),
                    Err(e) => println!("error detach: {}", chain(&e)),
                }
                return ExitCode::SUCCESS;
            }
            ["exit"] => break,
            _ => {
                println!("error {line}: unknown command");
                continue;
            }
        };
        match done {
            Ok(()) => println!("ok {line} {}", counters(&mut gate)),
            Err(e) => println!("error {line}: {}", chain(&e)),
        }
    }
    println!("ok exit (the plug stays and holds)");
    ExitCode::SUCCESS
}
