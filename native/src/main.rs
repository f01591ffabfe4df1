//! `valen-native-check EXPORT_DIR [--vectors FILE]`: exit 0 conforming, 1 not conforming
//! (one line per problem on stdout), 2 usage.

// `x % n == 0` rather than `is_multiple_of` (Rust 1.87) keeps older toolchains building it.
#![allow(clippy::manual_is_multiple_of)]

mod check;
mod config;
mod files;
mod head;
mod json;
mod language;
mod lora;
mod manifest;
mod report;
mod safetensors;
mod shapes;
mod sources;
mod vectors;
mod vision;

use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "usage: valen-native-check EXPORT_DIR [--vectors FILE]";

#[derive(Debug, PartialEq)]
struct Args {
    export_dir: PathBuf,
    vectors: Option<PathBuf>,
}

/// `Ok(None)` means help was asked for.
fn parse_args(args: &[String]) -> Result<Option<Args>, String> {
    let mut export_dir = None;
    let mut vectors = None;
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--vectors" => {
                let file = rest.next().ok_or("--vectors needs a FILE")?;
                if vectors.replace(PathBuf::from(file)).is_some() {
                    return Err("--vectors given twice".into());
                }
            }
            flag if flag.starts_with("--vectors=") => {
                let file = &flag["--vectors=".len()..];
                if vectors.replace(PathBuf::from(file)).is_some() {
                    return Err("--vectors given twice".into());
                }
            }
            flag if flag.starts_with('-') && flag.len() > 1 => {
                return Err(format!("unknown option {flag}"))
            }
            dir => {
                if export_dir.replace(PathBuf::from(dir)).is_some() {
                    return Err(format!("unexpected extra argument {dir}"));
                }
            }
        }
    }
    let export_dir = export_dir.ok_or("missing EXPORT_DIR")?;
    Ok(Some(Args {
        export_dir,
        vectors,
    }))
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse_args(&argv) {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("valen-native-check: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if !args.export_dir.is_dir() {
        eprintln!(
            "valen-native-check: {}: not a directory\n{USAGE}",
            args.export_dir.display()
        );
        return ExitCode::from(2);
    }
    if let Some(v) = &args.vectors {
        if !v.is_file() {
            eprintln!(
                "valen-native-check: --vectors {}: no such file\n{USAGE}",
                v.display()
            );
            return ExitCode::from(2);
        }
    }
    let mut problems = report::Problems::default();
    let export = check::check_export(&args.export_dir, &mut problems);
    if let (Some(vectors), Some(export)) = (&args.vectors, &export) {
        vectors::check(vectors, export, &mut problems);
    } else if args.vectors.is_some() {
        problems
            .push("vectors not checked: the export's manifest or config.json could not be read");
    }
    if problems.is_empty() {
        println!("{}: conforms to valen-native/1", args.export_dir.display());
        ExitCode::SUCCESS
    } else {
        for line in problems.lines() {
            println!("{line}");
        }
        ExitCode::from(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Option<Args>, String> {
        parse_args(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn parses_dir_and_vectors() {
        let args = parse(&["out", "--vectors", "v.json"]).unwrap().unwrap();
        assert_eq!(args.export_dir, PathBuf::from("out"));
        assert_eq!(args.vectors, Some(PathBuf::from("v.json")));
        let args = parse(&["--vectors=v.json", "out"]).unwrap().unwrap();
        assert_eq!(args.vectors, Some(PathBuf::from("v.json")));
    }

    #[test]
    fn refuses_bad_usage() {
        assert!(parse(&[]).is_err());
        assert!(parse(&["a", "b"]).is_err());
        assert!(parse(&["a", "--vectors"]).is_err());
        assert!(parse(&["a", "--frobnicate"]).is_err());
        assert_eq!(parse(&["--help"]).unwrap(), None);
    }
}
