//! An emulated host ([`crate::net`]) as a [`Site`]: this machine inside the host's network
//! namespace. `ip netns exec` enters the namespace and execs the program, so the child's pid is
//! the program's and signals and exit statuses are its own.

use std::ffi::{OsStr, OsString};
use std::process::Command;
use std::sync::Arc;

use crate::net::HostSlot;
use crate::site::{Site, Slot, loopback_port};

/// An emulated host's network namespace.
#[derive(Debug, Clone)]
pub struct Netns {
    /// The namespace's name.
    pub name: String,
}

impl Site for Netns {
    fn label(&self) -> Option<String> {
        Some(format!("emulated host {}", self.name))
    }

    fn command(&self, program: &OsStr, args: &[OsString], _input: bool) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program).args(args);
        c
    }

    fn is_child(&self) -> bool {
        true
    }

    fn free_port(&self) -> anyhow::Result<u16> {
        loopback_port()
    }
}

impl From<&HostSlot> for Slot {
    fn from(h: &HostSlot) -> Slot {
        Slot { addr: h.addr.clone(), site: Arc::new(Netns { name: h.netns.clone() }) }
    }
}
