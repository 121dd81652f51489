//! Every byte the tool prints goes through here, so that no write can panic: a closed
//! stdout (`oncedb verify | head -1`) ends the command as a success, any other write
//! failure is one error line and a non-zero exit, and a closed stderr is ignored.

use std::fmt;
use std::io::{self, Write};

/// Why a command stopped before its end.
#[derive(Debug)]
pub enum Failure {
    /// Stdout was closed by its reader: a normal end (exit 0).
    Closed,
    /// Anything else, with the message for stderr.
    Message(String),
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure::Message(message)
    }
}

impl From<&str> for Failure {
    fn from(message: &str) -> Self {
        Failure::Message(message.to_owned())
    }
}

impl From<io::Error> for Failure {
    fn from(err: io::Error) -> Self {
        if err.kind() == io::ErrorKind::BrokenPipe {
            Failure::Closed
        } else {
            Failure::Message(format!("writing the output: {err}"))
        }
    }
}

impl From<oncedb::Error> for Failure {
    fn from(err: oncedb::Error) -> Self {
        Failure::Message(err.to_string())
    }
}

/// Writes `args` to stdout.
pub fn text(args: fmt::Arguments<'_>) -> Result<(), Failure> {
    let mut out = io::stdout().lock();
    out.write_fmt(args)?;
    out.flush()?;
    Ok(())
}

/// Writes `args` and a newline to stdout.
pub fn line(args: fmt::Arguments<'_>) -> Result<(), Failure> {
    text(format_args!("{args}\n"))
}

/// Writes `args` and a newline to stderr, ignoring a closed stderr.
pub fn note(args: fmt::Arguments<'_>) {
    let _ = writeln!(io::stderr().lock(), "{args}");
}

/// `println!` that returns a [`Failure`] instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => { $crate::output::line(format_args!($($arg)*)) };
}

/// `print!` that returns a [`Failure`] instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => { $crate::output::text(format_args!($($arg)*)) };
}

/// `eprintln!` that never panics.
macro_rules! noteln {
    ($($arg:tt)*) => { $crate::output::note(format_args!($($arg)*)) };
}
