//! Progress of long operations (bulk intake, backup, restore) on standard error: a line redrawn
//! in place on a terminal, plain lines (at most one per tenth of the work, and the last) when
//! standard error is a file or a pipe, so logs stay readable.

use std::io::{IsTerminal, Write};

pub struct Progress {
    label: String,
    total: u64,
    done: u64,
    tty: bool,
    last_tenth: u64,
}

impl Progress {
    pub fn new(label: impl Into<String>, total: u64) -> Self {
        Self::with_terminal(label, total, std::io::stderr().is_terminal())
    }

    pub fn with_terminal(label: impl Into<String>, total: u64, tty: bool) -> Self {
        Self {
            label: label.into(),
            total,
            done: 0,
            tty,
            last_tenth: 0,
        }
    }

    /// The line for the current state, as printed.
    pub fn line(&self) -> String {
        let pct = (self.done * 100).checked_div(self.total).unwrap_or(100);
        format!("{}: {}/{} ({pct}%)", self.label, self.done, self.total)
    }

    /// Sets how much is done and prints when it is worth a line.
    pub fn set(&mut self, done: u64) {
        self.done = done.min(self.total);
        let mut err = std::io::stderr().lock();
        if self.tty {
            let _ = write!(err, "\r\x1b[2K{}", self.line());
            if self.done == self.total {
                let _ = writeln!(err);
            }
            let _ = err.flush();
            return;
        }
        let tenth = (self.done * 10).checked_div(self.total).unwrap_or(10);
        if tenth > self.last_tenth || self.done == self.total {
            if self.done == self.total && self.last_tenth == 11 {
                return;
            }
            self.last_tenth = if self.done == self.total { 11 } else { tenth };
            let _ = writeln!(err, "{}", self.line());
        }
    }

    pub fn inc(&mut self) {
        self.set(self.done + 1);
    }
}
