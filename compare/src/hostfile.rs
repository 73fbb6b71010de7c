//! The hosts of `compare --hosts`: a hostfile in DeepSpeed's and Horovod's form (one host a
//! line, `node0 slots=4`, `#` comments and blank lines allowed, `addr=` optionally naming the
//! address the other hosts reach it at), or the same list inline (`node0:4,node1:4`).

use std::path::Path;

use anyhow::Context;

/// One host of the list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostEntry {
    /// What `ssh` is given: a name (an alias of the user's ssh config, `user@host`) or address.
    pub name: String,
    /// Processes it takes (its GPUs, or cores): workers are spread over hosts up to these.
    pub slots: usize,
    /// The address the other hosts reach it at, when given (else the `HostName` ssh resolves
    /// the name to).
    pub addr: Option<String>,
}

/// `--hosts`: a hostfile's path when one exists there, else the inline form.
pub fn parse_arg(arg: &str) -> anyhow::Result<Vec<HostEntry>> {
    let path = Path::new(arg);
    if path.is_file() {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading --hosts {arg}"))?;
        return parse_file(&text, &path.display().to_string());
    }
    anyhow::ensure!(
        !arg.contains('/') && !arg.trim().is_empty(),
        "--hosts {arg}: no such hostfile, and not a host list such as node0:4,node1:4"
    );
    parse_inline(arg)
}

/// The inline form: `node0:4,node1:4` (a host without `:N` has one slot).
pub fn parse_inline(list: &str) -> anyhow::Result<Vec<HostEntry>> {
    let mut hosts = Vec::new();
    for item in list.split(',').map(str::trim) {
        anyhow::ensure!(!item.is_empty(), "--hosts {list}: an empty host name");
        let (name, slots) = match item.rsplit_once(':') {
            Some((n, s)) => (n, parse_slots(s).with_context(|| format!("--hosts {list}: host {n}"))?),
            None => (item, 1),
        };
        check_name(name).with_context(|| format!("--hosts {list}"))?;
        hosts.push(HostEntry { name: name.to_string(), slots, addr: None });
    }
    unique(&hosts).with_context(|| format!("--hosts {list}"))?;
    Ok(hosts)
}

/// A hostfile's text; `file` names it in errors, with the line.
pub fn parse_file(text: &str, file: &str) -> anyhow::Result<Vec<HostEntry>> {
    let mut hosts = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let at = || format!("{file}:{}", i + 1);
        let line = raw.split_once('#').map_or(raw, |(l, _)| l).trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let name = words.next().unwrap_or_default();
        check_name(name).with_context(at)?;
        let mut entry = HostEntry { name: name.to_string(), slots: 1, addr: None };
        for w in words {
            match w.split_once('=') {
                Some(("slots", v)) => entry.slots = parse_slots(v).with_context(at)?,
                Some(("addr", v)) if !v.is_empty() => entry.addr = Some(v.to_string()),
                _ => anyhow::bail!("{}: `{w}`: expected slots=N or addr=ADDRESS after the host name", at()),
            }
        }
        hosts.push(entry);
    }
    anyhow::ensure!(!hosts.is_empty(), "{file}: no hosts (one a line: `node0 slots=4`)");
    unique(&hosts).with_context(|| file.to_string())?;
    Ok(hosts)
}

fn parse_slots(s: &str) -> anyhow::Result<usize> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => anyhow::bail!("slots `{s}`: expected a whole number of at least 1"),
    }
}

/// A name ssh can be given and a shell passes through unchanged: no spaces, quotes or
/// options in disguise.
fn check_name(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && !name.starts_with('-')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-@:[]%".contains(&b));
    anyhow::ensure!(ok, "`{name}` is not a host name");
    Ok(())
}

fn unique(hosts: &[HostEntry]) -> anyhow::Result<()> {
    for (i, h) in hosts.iter().enumerate() {
        anyhow::ensure!(!hosts[..i].iter().any(|o| o.name == h.name), "host {} is listed twice", h.name);
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_hostfile_takes_comments_blank_lines_and_slots_and_names_a_bad_line() {
        let text = "# the cluster\n\nnode0 slots=4\n  node1   slots=2  # two GPUs\nnode2\nnode3 slots=1 addr=10.0.0.4\n";
        let h = parse_file(text, "hosts.txt").unwrap();
        let got: Vec<(&str, usize)> = h.iter().map(|h| (h.name.as_str(), h.slots)).collect();
        assert_eq!(got, [("node0", 4), ("node1", 2), ("node2", 1), ("node3", 1)]);
        assert_eq!(h[3].addr.as_deref(), Some("10.0.0.4"));
        for (bad, line, says) in [
            ("node0 slots=4\nnode1 slots=zero\n", 2, "slots `zero`"),
            ("node0 slots=0\n", 1, "at least 1"),
            ("\n\nnode0 gpus=4\n", 3, "`gpus=4`"),
            ("node0 'x\n", 1, "`'x`"),
            ("-oProxyCommand=x\n", 1, "not a host name"),
        ] {
            let e = format!("{:#}", parse_file(bad, "hosts.txt").unwrap_err());
            assert!(e.contains(&format!("hosts.txt:{line}")) && e.contains(says), "{bad:?}: {e}");
        }
        let e = format!("{:#}", parse_file("# nothing\n", "h").unwrap_err());
        assert!(e.contains("no hosts"), "{e}");
        let e = format!("{:#}", parse_file("a\na slots=2\n", "h").unwrap_err());
        assert!(e.contains("host a is listed twice"), "{e}");
    }

    #[test]
    fn the_inline_list_is_horovods() {
        let h = parse_inline("node0:4,node1:2,node2").unwrap();
        let got: Vec<(&str, usize)> = h.iter().map(|h| (h.name.as_str(), h.slots)).collect();
        assert_eq!(got, [("node0", 4), ("node1", 2), ("node2", 1)]);
        assert_eq!(parse_arg("10.77.0.2:2,10.77.0.3:2").unwrap().len(), 2);
        for bad in ["node0:x", "node0:0", "a,,b", "a b:2"] {
            assert!(parse_inline(bad).is_err(), "{bad}");
        }
        let e = format!("{:#}", parse_arg("/no/such/hostfile").unwrap_err());
        assert!(e.contains("no such hostfile"), "{e}");
    }
}
