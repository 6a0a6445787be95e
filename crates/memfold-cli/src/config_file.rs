//! A command's settings from a TOML file (memfoldd's `/etc/memfold/memfoldd.toml`).
//!
//! Every key is one of the command's long flags, spelled as on the command line without
//! the dashes (`rate = 500`, `share-domains = "vm"`, `host-budget-mib = 2048`); its value
//! becomes that flag's argument. No key is handled by code of its own: [`file_args`]
//! checks each key against the command's arguments (clap's [`Command`]) and turns the file
//! into arguments that [`parse_layered`] puts before the real command line, with clap's
//! `args_override_self`, so a flag given on the command line wins over the file (a
//! repeatable flag given there replaces the file's values) and the file over the built-in
//! defaults. A flag added to the command is a valid key at once. A flag on the command
//! line also replaces the file's keys it conflicts with (`--agent-gid` a file's
//! `agent-group`); two such keys in one file are an error. What a flag requires
//! (`metrics-allow-remote` needs `metrics-listen`) may come from the file or the
//! command line.
//!
//! Values: a string, integer or float is the flag's argument as written; a boolean is
//! the argument `true`/`false`, or for a switch (a flag without a value) turns it on
//! (`true`) or leaves it off (`false`); an array gives a flag that may be repeated one
//! argument per element. A key that is not a flag, a table, or a value the flag does not
//! take is an error naming the file, the line and the key (and, for an unknown key, the
//! valid keys).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Command, Id};

/// Errors of a configuration file, each naming the file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    /// The file could not be read.
    #[error("{path}: cannot read the configuration: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The file is not a TOML table of keys and values.
    #[error("{path}: not valid TOML: {message}")]
    Syntax {
        /// The file.
        path: PathBuf,
        /// What the TOML parser said (with the line and column).
        message: String,
    },
    /// A key that is none of the command's flags.
    #[error("{path}:{line}: unknown key `{key}`{hint}; valid keys: {valid}")]
    UnknownKey {
        /// The file.
        path: PathBuf,
        /// The key's line, from 1.
        line: usize,
        /// The key.
        key: String,
        /// A suggestion (`, did you mean ...`), or empty.
        hint: String,
        /// Every valid key, comma-separated.
        valid: String,
    },
    /// A value the key's flag does not take.
    #[error("{path}:{line}: `{key}`: {why}")]
    Value {
        /// The file.
        path: PathBuf,
        /// The key's line, from 1.
        line: usize,
        /// The key.
        key: String,
        /// What is wrong with its value.
        why: String,
    },
    /// Two keys whose flags may not be given together.
    #[error(
        "{path}:{line}: `{key}` cannot be set with `{other}` (line {other_line}): set one of them"
    )]
    Conflict {
        /// The file.
        path: PathBuf,
        /// The later key's line, from 1.
        line: usize,
        /// The later key.
        key: String,
        /// The earlier key.
        other: String,
        /// The earlier key's line, from 1.
        other_line: usize,
    },
    /// The file's settings with the command line's are refused, though the command line
    /// alone is not (a key that requires a flag neither gives).
    #[error("{path}: its settings with the command line's are refused: {message}")]
    Combined {
        /// The file.
        path: PathBuf,
        /// clap's whole message.
        message: String,
    },
}

/// The keys a file may set: every long flag of `cmd` but `--help`, `--version` and the
/// flags in `except` (the one that names the file itself), sorted.
pub fn valid_keys(cmd: &Command, except: &[&str]) -> Vec<String> {
    let mut keys: Vec<String> = cmd
        .get_arguments()
        .filter_map(|a| a.get_long())
        .filter(|l| !["help", "version"].contains(l) && !except.contains(l))
        .map(str::to_owned)
        .collect();
    keys.sort();
    keys
}

/// The 1-based line of byte offset `at` in `text`.
fn line_of(text: &str, at: usize) -> usize {
    text.as_bytes()[..at.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// The arguments the file `path` (read as `text`) stands for, for `cmd`: each key as
/// `--key=value`, in key order. `except`: flags that may not be set from a file. Each
/// key's arguments are checked by clap alone, so an error names the file, the line and
/// the key; what spans keys (conflicts, requirements) [`parse_layered`] checks.
///
/// Errors: [`ConfigFileError`] (not TOML, an unknown key, a value the flag does not
/// take).
pub fn file_args(
    cmd: &Command,
    path: &Path,
    text: &str,
    except: &[&str],
) -> Result<Vec<OsString>, ConfigFileError> {
    Ok(keyed_args(cmd, path, text, except)?
        .into_iter()
        .flat_map(|k| k.args)
        .collect())
}

/// One key of a file: its flag and the arguments it stands for.
struct Keyed {
    /// The flag's id.
    id: Id,
    /// The key as written.
    key: String,
    /// Its line, from 1.
    line: usize,
    /// Its arguments (`--key=value`, none for a switch left off).
    args: Vec<OsString>,
}

/// Whether clap refuses the flags `a` and `b` together; it lists a conflict on one of
/// the two only (`conflicts_with` on one side), so both are asked.
fn conflict(cmd: &Command, a: &Id, b: &Id) -> bool {
    let find = |id: &Id| cmd.get_arguments().find(|x| x.get_id() == id);
    let (Some(x), Some(y)) = (find(a), find(b)) else {
        return false;
    };
    cmd.get_arg_conflicts_with(x)
        .iter()
        .any(|c| c.get_id() == b)
        || cmd
            .get_arg_conflicts_with(y)
            .iter()
            .any(|c| c.get_id() == a)
}

/// clap's message for `e`, all of it, without its `error: ` prefix.
fn clap_message(e: &clap::Error) -> String {
    let m = e.to_string();
    m.trim_start_matches("error: ").trim_end().to_owned()
}

/// [`file_args`], by key.
fn keyed_args(
    cmd: &Command,
    path: &Path,
    text: &str,
    except: &[&str],
) -> Result<Vec<Keyed>, ConfigFileError> {
    type Spanned<T> = toml::Spanned<T>;
    let table: BTreeMap<Spanned<String>, Spanned<toml::Value>> =
        toml::from_str(text).map_err(|e| ConfigFileError::Syntax {
            path: path.to_owned(),
            message: e.to_string().trim_end().replace('\n', " "),
        })?;
    let valid = valid_keys(cmd, except);
    let cmd = cmd.clone().args_override_self(true);
    let mut out = Vec::new();
    for (key, value) in &table {
        let line = line_of(text, key.span().start);
        let name = key.get_ref().as_str();
        let value_err = |why: String| ConfigFileError::Value {
            path: path.to_owned(),
            line,
            key: name.to_owned(),
            why,
        };
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(name))
            .filter(|_| valid.iter().any(|k| k == name));
        let Some(arg) = arg else {
            let dashed = name.replace('_', "-");
            let hint = if dashed != name && valid.contains(&dashed) {
                format!(", did you mean `{dashed}`")
            } else {
                String::new()
            };
            return Err(ConfigFileError::UnknownKey {
                path: path.to_owned(),
                line,
                key: name.to_owned(),
                hint,
                valid: valid.join(", "),
            });
        };
        let switch = matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse);
        let repeated = matches!(arg.get_action(), ArgAction::Append);
        let scalar = |v: &toml::Value| -> Result<String, ConfigFileError> {
            match v {
                toml::Value::String(s) => Ok(s.clone()),
                toml::Value::Integer(i) => Ok(i.to_string()),
                toml::Value::Float(f) => Ok(f.to_string()),
                toml::Value::Boolean(b) => Ok(b.to_string()),
                toml::Value::Datetime(d) => Ok(d.to_string()),
                toml::Value::Array(_) | toml::Value::Table(_) => {
                    Err(value_err("takes one value, not an array or a table".into()))
                }
            }
        };
        let mut mine: Vec<OsString> = Vec::new();
        match value.get_ref() {
            toml::Value::Boolean(on) if switch => {
                // SetFalse: the switch's presence sets false; `key = true` leaves it.
                let present = *on == matches!(arg.get_action(), ArgAction::SetTrue);
                if present {
                    mine.push(format!("--{name}").into());
                }
            }
            _ if switch => return Err(value_err("is a switch: true or false".into())),
            toml::Value::Array(items) if repeated => {
                for v in items {
                    mine.push(format!("--{name}={}", scalar(v)?).into());
                }
            }
            v => mine.push(format!("--{name}={}", scalar(v)?).into()),
        }
        let alone = std::iter::once(OsString::from(cmd.get_name())).chain(mine.iter().cloned());
        match cmd.clone().try_get_matches_from(alone) {
            // What the flag requires may be another key or on the command line: the
            // final parse checks it (values are parsed before requirements).
            Err(e) if e.kind() != ErrorKind::MissingRequiredArgument => {
                let why = e.to_string();
                let why = why
                    .lines()
                    .next()
                    .unwrap_or("")
                    .trim_start_matches("error: ");
                return Err(value_err(why.to_owned()));
            }
            _ => {}
        }
        out.push(Keyed {
            id: arg.get_id().clone(),
            key: name.to_owned(),
            line,
            args: mine,
        });
    }
    Ok(out)
}

/// Refuses two keys of the file `path` whose flags conflict, whatever the command line.
///
/// Errors: [`ConfigFileError::Conflict`], naming both keys and their lines.
fn refuse_conflicts(cmd: &Command, path: &Path, keyed: &[Keyed]) -> Result<(), ConfigFileError> {
    // A switch set to its default gives no argument, so conflicts with nothing.
    let set: Vec<&Keyed> = keyed.iter().filter(|k| !k.args.is_empty()).collect();
    for (i, a) in set.iter().enumerate() {
        if let Some(b) = set[i + 1..].iter().find(|b| conflict(cmd, &a.id, &b.id)) {
            let (first, later) = if a.line <= b.line { (a, b) } else { (b, a) };
            return Err(ConfigFileError::Conflict {
                path: path.to_owned(),
                line: later.line,
                key: later.key.clone(),
                other: first.key.clone(),
                other_line: first.line,
            });
        }
    }
    Ok(())
}

/// Where a command's configuration comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// No file: the defaults and the command line.
    None,
    /// A file that must exist (named on the command line).
    File(PathBuf),
    /// The default file, if it exists.
    Default(PathBuf),
}

impl Source {
    /// The source of a `--config` value: `none` for no file, a path for that file, and
    /// `default` when the flag is absent.
    pub fn of(flag: Option<&Path>, default: &Path) -> Source {
        match flag {
            Some(p) if p == Path::new("none") => Source::None,
            Some(p) => Source::File(p.to_owned()),
            None => Source::Default(default.to_owned()),
        }
    }

    /// The file to read, if any: a named one always (it must exist), the default one if
    /// it exists.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Source::None => None,
            Source::File(p) => Some(p),
            Source::Default(p) => p.exists().then_some(p.as_path()),
        }
    }
}

/// What [`parse_layered`] can fail on.
#[derive(Debug, thiserror::Error)]
pub enum LayeredError {
    /// The command line itself, or a requirement of its flags that the file does not
    /// meet either (clap's message, with usage; `--help` and `--version` come this way
    /// too).
    #[error("{0}")]
    Cli(#[from] clap::Error),
    /// The configuration file.
    #[error(transparent)]
    File(#[from] ConfigFileError),
}

/// Parses `argv` (with the program name first) as `P` with the settings of the file
/// `source(&P)` names beneath it: command line over file over defaults. `flag`: the long
/// name of the flag that names the file (not a valid key in the file). Returns the
/// arguments and the file read, if any.
///
/// Errors: [`LayeredError`]: the command line is invalid (or asks for help), the file
/// cannot be read or is invalid, alone or with the command line.
pub fn parse_layered<P: clap::Parser>(
    argv: &[OsString],
    flag: &str,
    source: impl Fn(&P) -> Source,
) -> Result<(P, Option<PathBuf>), LayeredError> {
    let cmd = P::command().args_override_self(true);
    // The file may give what a flag here requires: parsed again without that check (the
    // only error left), the command line is judged with the file below.
    let (given, lacking) = match cmd.clone().try_get_matches_from(argv) {
        Ok(m) => (m, None),
        Err(e) if e.kind() == ErrorKind::MissingRequiredArgument => {
            match cmd.clone().ignore_errors(true).try_get_matches_from(argv) {
                Ok(m) => (m, Some(e)),
                Err(_) => return Err(e.into()),
            }
        }
        Err(e) => return Err(e.into()),
    };
    let first = match P::from_arg_matches(&given) {
        Ok(p) => p,
        Err(e) => return Err(lacking.unwrap_or(e).into()),
    };
    let Some(path) = source(&first).path().map(Path::to_owned) else {
        return match lacking {
            Some(e) => Err(e.into()),
            None => Ok((first, None)),
        };
    };
    let text = std::fs::read_to_string(&path).map_err(|source| ConfigFileError::Read {
        path: path.clone(),
        source,
    })?;
    let on_line: Vec<&Id> = cmd
        .get_arguments()
        .map(|a| a.get_id())
        .filter(|id| given.value_source(id.as_str()) == Some(ValueSource::CommandLine))
        .collect();
    // A flag on the command line replaces the file's value, a repeated one too (clap
    // would add its values to the file's), and the keys it conflicts with.
    let keyed = keyed_args(&cmd, &path, &text, &[flag])?;
    refuse_conflicts(&cmd, &path, &keyed)?;
    let from_file = keyed
        .into_iter()
        .filter(|k| {
            !on_line
                .iter()
                .any(|g| *g == &k.id || conflict(&cmd, g, &k.id))
        })
        .flat_map(|k| k.args);
    let mut all: Vec<OsString> = Vec::new();
    all.extend(argv.first().cloned());
    all.extend(from_file);
    all.extend(argv.iter().skip(1).cloned());
    let combined = |e: clap::Error| ConfigFileError::Combined {
        path: path.clone(),
        message: clap_message(&e),
    };
    let m: ArgMatches = match cmd.try_get_matches_from(all) {
        Ok(m) => m,
        // The command line lacks what the file does not give either: its own error.
        Err(e) if e.kind() == ErrorKind::MissingRequiredArgument && lacking.is_some() => {
            return Err(lacking.unwrap_or(e).into());
        }
        // Otherwise the command line was valid alone: the file's part is at fault.
        Err(e) => return Err(combined(e).into()),
    };
    let p = P::from_arg_matches(&m).map_err(combined)?;
    Ok((p, Some(path)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    /// A command like memfoldd's: options with defaults, an optional one, a switch, a
    /// repeatable one and the flag naming the file.
    #[derive(Parser, Debug)]
    struct Cli {
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long, default_value_t = 7)]
        rate: u64,
        #[arg(long, default_value = "user", value_parser = ["user", "vm"])]
        share_domains: String,
        #[arg(long)]
        budget_mib: Option<u64>,
        #[arg(long)]
        clock_secs: Option<f64>,
        #[arg(long)]
        verbose: bool,
        #[arg(long)]
        listen: Vec<String>,
    }

    fn args(text: &str) -> Result<Vec<String>, ConfigFileError> {
        Ok(
            file_args(&Cli::command(), Path::new("/f.toml"), text, &["config"])?
                .into_iter()
                .map(|s| s.into_string().unwrap())
                .collect(),
        )
    }

    fn layered(text: &str, argv: &[&str]) -> Result<Cli, LayeredError> {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, text).unwrap();
        let mut v: Vec<OsString> = vec!["cli".into(), "--config".into(), f.clone().into()];
        v.extend(argv.iter().map(OsString::from));
        let (cli, read) = parse_layered::<Cli>(&v, "config", |c: &Cli| {
            Source::of(c.config.as_deref(), Path::new("/nonexistent"))
        })?;
        assert_eq!(read.as_deref(), Some(f.as_path()));
        Ok(cli)
    }

    #[test]
    fn every_value_kind_becomes_its_flags_argument() {
        let a = args(
            "rate = 500\nshare-domains = \"vm\"\nclock-secs = 2.5\nverbose = true\nlisten = [\"a\", \"b\"]\n",
        )
        .unwrap();
        assert_eq!(
            a,
            [
                "--clock-secs=2.5",
                "--listen=a",
                "--listen=b",
                "--rate=500",
                "--share-domains=vm",
                "--verbose"
            ]
        );
        assert_eq!(args("verbose = false").unwrap(), Vec::<String>::new());
        assert_eq!(args("# all commented\n").unwrap(), Vec::<String>::new());
    }

    #[test]
    fn errors_name_the_file_the_line_and_the_key() {
        let e = args("rate = 1\n\nswap_dir = \"/x\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("/f.toml:3: unknown key `swap_dir`"), "{e}");
        assert!(
            e.contains("valid keys: budget-mib, clock-secs, listen, rate, share-domains, verbose"),
            "{e}"
        );
        assert!(
            !e.contains("config,"),
            "the file may not name another file: {e}"
        );
        let e = args("budget_mib = 1").unwrap_err().to_string();
        assert!(e.contains("did you mean `budget-mib`"), "{e}");
        let e = args("rate = 1\nshare-domains = \"all\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("/f.toml:2: `share-domains`: invalid value 'all'"),
            "{e}"
        );
        let e = args("rate = -3").unwrap_err().to_string();
        assert!(e.starts_with("/f.toml:1: `rate`: "), "{e}");
        let e = args("verbose = 1").unwrap_err().to_string();
        assert!(e.contains("is a switch"), "{e}");
        let e = args("rate = [1, 2]").unwrap_err().to_string();
        assert!(e.contains("takes one value"), "{e}");
        let e = args("config = \"/etc/other.toml\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown key `config`"), "{e}");
        let e = args("rate = ").unwrap_err().to_string();
        assert!(e.starts_with("/f.toml: not valid TOML"), "{e}");
    }

    #[test]
    fn the_command_line_wins_over_the_file_and_the_file_over_defaults() {
        let c = layered("rate = 500\nshare-domains = \"vm\"\nbudget-mib = 64\n", &[]).unwrap();
        assert_eq!(
            (c.rate, c.share_domains.as_str(), c.budget_mib),
            (500, "vm", Some(64))
        );
        let c = layered("rate = 500\nshare-domains = \"vm\"\n", &["--rate", "9"]).unwrap();
        assert_eq!((c.rate, c.share_domains.as_str()), (9, "vm"));
        let c = layered("listen = [\"a\"]\n", &["--listen", "b"]).unwrap();
        assert_eq!(
            c.listen,
            ["b"],
            "a repeated flag on the command line replaces the file's"
        );
        assert!(matches!(
            layered("rate = 1\nbogus = 2\n", &[]),
            Err(LayeredError::File(ConfigFileError::UnknownKey {
                line: 2,
                ..
            }))
        ));
    }

    #[test]
    fn sources_none_default_and_named() {
        let missing = Path::new("/nonexistent/memfoldd.toml");
        assert_eq!(Source::of(Some(Path::new("none")), missing).path(), None);
        assert_eq!(
            Source::of(None, missing).path(),
            None,
            "a missing default file is no file"
        );
        let named = Source::of(Some(missing), missing);
        assert_eq!(
            named.path(),
            Some(missing),
            "a named file must exist: it is read"
        );
        let v: Vec<OsString> = ["cli", "--config", "/nonexistent/memfoldd.toml"]
            .iter()
            .map(OsString::from)
            .collect();
        let e = parse_layered::<Cli>(&v, "config", |c: &Cli| {
            Source::of(c.config.as_deref(), Path::new("/none"))
        })
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("/nonexistent/memfoldd.toml: cannot read"),
            "{e}"
        );
    }
}
