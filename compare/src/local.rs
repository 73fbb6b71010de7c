//! This machine as a [`Site`]: a process started here is a child of the runner, run as it is,
//! its files written in place.

use std::ffi::{OsStr, OsString};
use std::process::Command;

use crate::site::{Site, loopback_port};

/// This machine, as it is.
#[derive(Debug, Clone, Copy, Default)]
pub struct Local;

impl Site for Local {
    fn label(&self) -> Option<String> {
        None
    }

    fn command(&self, program: &OsStr, args: &[OsString], _input: bool) -> Command {
        let mut c = Command::new(program);
        c.args(args);
        c
    }

    fn is_child(&self) -> bool {
        true
    }

    fn free_port(&self) -> anyhow::Result<u16> {
        loopback_port()
    }
}
