//! `gradsync-worker supervise`, as `compare --hosts` runs it on another host: the environment
//! block from stdin reaches the program (and no command line), and the end of stdin stops the
//! program's whole process group, grandchildren included; the program's own exit stops what
//! it left behind.
#![allow(clippy::unwrap_used)] // a test fails loudly on anything unexpected

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gradsync_testkit::process::{Proc, binary};

/// Start `script` under the supervisor with `GRADSYNC_TOKEN=s3cret` sent on stdin; returns the
/// process (stdin still open) and the lines the script prints.
fn supervised(script: &str) -> (Proc, std::sync::mpsc::Receiver<String>) {
    let mut c = Command::new(binary("gradsync-worker"));
    c.args(["supervise", "--grace", "2", "--", "sh", "-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    let mut child = c.spawn().unwrap();
    child.stdin.as_mut().unwrap().write_all(b"GRADSYNC_TOKEN=s3cret\n\n").unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    (Proc::adopt(child), rx)
}

fn alive(pid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

fn gone_within(pid: i32, limit: Duration) -> bool {
    let until = Instant::now() + limit;
    while alive(pid) {
        if Instant::now() > until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

#[test]
fn the_end_of_stdin_stops_the_programs_whole_group() {
    // The program prints its token and a grandchild's pid, then waits.
    let (mut p, lines) = supervised("sleep 300 & echo \"$GRADSYNC_TOKEN $!\"; wait");
    let line = lines.recv_timeout(Duration::from_secs(30)).unwrap();
    let (token, grandchild) = line.split_once(' ').unwrap();
    assert_eq!(token, "s3cret");
    let grandchild: i32 = grandchild.parse().unwrap();
    assert!(alive(grandchild));
    // The connection ends: stdin closes.
    drop(p.child().stdin.take());
    let t = Instant::now();
    let st = loop {
        if let Some(st) = p.child().try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "the supervisor outlived its stdin");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(!st.success(), "stopped, not finished: {st}");
    assert!(gone_within(grandchild, Duration::from_secs(5)), "the grandchild {grandchild} was left running");
}

#[test]
fn the_programs_exit_is_the_supervisors_and_ends_what_it_left() {
    let (mut p, lines) = supervised("sleep 300 & echo $!; exit 7");
    let grandchild: i32 = lines.recv_timeout(Duration::from_secs(30)).unwrap().parse().unwrap();
    let (code, _, _) = p.finish(Duration::from_secs(30));
    assert_eq!(code, 7);
    assert!(gone_within(grandchild, Duration::from_secs(5)), "the grandchild {grandchild} was left running");
}
