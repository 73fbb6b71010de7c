//! The house rules every crate keeps, checked over the whole tree from the source text:
//!
//! - no two source files import each other, directly or round a loop (within a crate; a parent
//!   module re-exporting its own children with `pub use` is a front, not an import);
//! - no function longer than [`LONGEST`] lines outside tests, unless a `// Long:` comment
//!   just above it says why it must be;
//! - docs/architecture.md names every source file, in the paragraph of its folder.
//!
//! Each rule reads the files as text (comments and literals blanked first), so it needs no
//! compiler and runs in a moment; each failure names the files and lines to look at.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The longest a function may be, in lines from `fn` to its closing brace.
const LONGEST: usize = 150;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("testkit sits in the repository").to_path_buf()
}

/// The workspace's crates: folders at the top with a Cargo.toml and a `src/`.
fn crates(root: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(root)
        .expect("reading the repository")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("Cargo.toml").is_file() && p.join("src").is_dir())
        .filter(|p| p.file_name().is_some_and(|n| n != "fuzz" && n != "target"))
        .collect();
    out.sort();
    out
}

/// Every file under `dir` (recursively) whose name ends in one of `exts`.
fn files(dir: &Path, exts: &[&str], out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for p in entries {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        if p.is_dir() {
            if name != "target" && !name.starts_with('.') && name != "__pycache__" {
                files(&p, exts, out);
            }
        } else if exts.is_empty() || exts.iter().any(|e| name.ends_with(e)) {
            out.push(p);
        }
    }
}

/// Rust source with comments, strings and character literals replaced by spaces, newlines
/// kept, so that braces and paths can be read off it by line.
fn blank(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let keep = |c: u8| if c == b'\n' { b'\n' } else { b' ' };
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    out.extend([b' ', b' ']);
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    out.extend([b' ', b' ']);
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(keep(b[i]));
                    i += 1;
                }
            }
        } else if (c == b'r' || c == b'b')
            && !b.get(i.wrapping_sub(1)).is_some_and(|p| p.is_ascii_alphanumeric() || *p == b'_')
            && raw_string_start(b, i).is_some()
        {
            let (hashes, body) = raw_string_start(b, i).unwrap_or((0, i));
            out.extend(std::iter::repeat_n(b' ', body - i));
            i = body;
            loop {
                if i >= b.len() {
                    break;
                }
                if b[i] == b'"' && b[i + 1..].iter().take(hashes).filter(|&&h| h == b'#').count() == hashes {
                    out.extend(std::iter::repeat_n(b' ', hashes + 1));
                    i += hashes + 1;
                    break;
                }
                out.push(keep(b[i]));
                i += 1;
            }
        } else if c == b'"' {
            out.push(b' ');
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    out.push(b' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(keep(b[i]));
                    i += 1;
                }
            }
            out.push(b' ');
            i += 1;
        } else if c == b'\'' {
            // A character literal ('x', '\n', '\u{..}'), not a lifetime ('a).
            let end = if b.get(i + 1) == Some(&b'\\') {
                b[i + 2..].iter().position(|&x| x == b'\'').map(|p| i + 2 + p)
            } else if b.get(i + 2) == Some(&b'\'') {
                Some(i + 2)
            } else {
                // A multi-byte character: up to 4 bytes then a quote.
                (i + 2..(i + 6).min(b.len())).find(|&j| b[j] == b'\'' && b[i + 1] >= 0x80)
            };
            match end {
                Some(e) => {
                    out.extend(std::iter::repeat_n(b' ', e + 1 - i));
                    i = e + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Where a raw string starting at `i` (`r"`, `r#"`, `br#"`) has its body: the count of `#`
/// and the index after the opening quote.
fn raw_string_start(b: &[u8], i: usize) -> Option<(usize, usize)> {
    let mut j = i;
    if b.get(j) == Some(&b'b') {
        j += 1;
    }
    if b.get(j) != Some(&b'r') {
        return None;
    }
    j += 1;
    let hashes = b[j..].iter().take_while(|&&h| h == b'#').count();
    j += hashes;
    (b.get(j) == Some(&b'"')).then_some((hashes, j + 1))
}

/// The index of the brace that closes the one at `open` in blanked text.
fn closing(text: &[u8], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (k, &c) in text.iter().enumerate().skip(open) {
        match c {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(k);
                }
            }
            _ => {}
        }
    }
    None
}

/// Blanked text with every item under `#[cfg(test)]` (a `mod tests { ... }`, a `use`, a
/// function) blanked too: tests are not the house.
fn without_tests(text: &str) -> String {
    let mut b = text.as_bytes().to_vec();
    let mut from = 0;
    while let Some(p) = find(&b, b"#[cfg(test)]", from) {
        from = p + 1;
        // Past any further attributes (`#[allow(...)]`) to the item itself.
        let mut after = skip_ws(&b, p + b"#[cfg(test)]".len());
        while b[after..].starts_with(b"#[") {
            let Some(end) = b[after..].iter().position(|&c| c == b']').map(|e| after + e) else { break };
            after = skip_ws(&b, end + 1);
        }
        // The item ends at its first `;` outside braces, or with the brace that closes its body.
        let Some(open) = b[after..].iter().position(|&c| c == b'{' || c == b';').map(|o| after + o) else {
            continue;
        };
        let end = if b[open] == b';' { Some(open) } else { closing(&b, open) };
        if let Some(end) = end {
            for c in &mut b[p..=end] {
                if *c != b'\n' {
                    *c = b' ';
                }
            }
        }
    }
    String::from_utf8_lossy(&b).into_owned()
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    hay.get(from..)?.windows(needle.len()).position(|w| w == needle).map(|p| p + from)
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// One crate's modules: module path -> file, and each file's module path.
struct Modules {
    by_path: BTreeMap<Vec<String>, PathBuf>,
}

impl Modules {
    fn read(src: &Path) -> (Modules, Vec<(PathBuf, Vec<String>)>) {
        let mut all = Vec::new();
        files(src, &[".rs"], &mut all);
        let mut by_path = BTreeMap::new();
        let mut list = Vec::new();
        for f in all {
            let rel = f.strip_prefix(src).expect("under src").to_path_buf();
            let mut segs: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
            let last = segs.pop().unwrap_or_default();
            if segs.first().is_some_and(|s| s == "bin") {
                continue;
            }
            match last.as_str() {
                "main.rs" if segs.is_empty() => continue,
                "lib.rs" if segs.is_empty() => {}
                "mod.rs" => {}
                other => segs.push(other.trim_end_matches(".rs").to_string()),
            }
            by_path.insert(segs.clone(), f.clone());
            list.push((f, segs));
        }
        (Modules { by_path }, list)
    }

    /// The file a path names, read from module `base`: the longest run of its segments that
    /// are modules.
    fn resolve(&self, base: &[String], segs: &[String]) -> Option<&PathBuf> {
        let mut cur = base.to_vec();
        for s in segs {
            let mut next = cur.clone();
            next.push(s.clone());
            if self.by_path.contains_key(&next) {
                cur = next;
            } else {
                break;
            }
        }
        self.by_path.get(&cur)
    }
}

/// The paths a `use` tree names, each as its segments (`a::{b, c::d}` -> `a::b`, `a::c::d`).
fn expand_use(tree: &str) -> Vec<Vec<String>> {
    fn go(prefix: &[String], s: &str, out: &mut Vec<Vec<String>>) {
        let s = s.trim();
        if s.is_empty() {
            return;
        }
        if let Some(open) = s.find('{') {
            let head: Vec<String> =
                s[..open].split("::").map(str::trim).filter(|x| !x.is_empty()).map(String::from).collect();
            let close = s.rfind('}').unwrap_or(s.len());
            let inner = &s[open + 1..close];
            let mut p = prefix.to_vec();
            p.extend(head);
            let (mut depth, mut start) = (0, 0);
            for (k, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        go(&p, &inner[start..k], out);
                        start = k + 1;
                    }
                    _ => {}
                }
            }
            go(&p, &inner[start..], out);
            return;
        }
        let s = s.split(" as ").next().unwrap_or(s);
        let mut p = prefix.to_vec();
        p.extend(
            s.split("::")
                .map(str::trim)
                .filter(|x| !x.is_empty() && *x != "self" && *x != "*")
                .map(String::from),
        );
        out.push(p);
    }
    let mut out = Vec::new();
    go(&[], tree, &mut out);
    out
}

/// The files `file` (module `module`) imports within its crate.
fn imports(mods: &Modules, file: &Path, module: &[String]) -> BTreeSet<PathBuf> {
    let text = without_tests(&blank(&std::fs::read_to_string(file).expect("reading a source file")));
    let b = text.as_bytes();
    let is_dir_module = file.file_name().is_some_and(|n| n == "mod.rs" || n == "lib.rs");
    // `super` of a non-mod file is its parent module; its `self` is its own module.
    let parent: Vec<String> = module[..module.len().saturating_sub(1)].to_vec();
    let children: BTreeSet<String> = {
        let mut c = BTreeSet::new();
        for line in text.lines() {
            let t = line.trim_start();
            let t = t.strip_prefix("pub(crate) ").or_else(|| t.strip_prefix("pub ")).unwrap_or(t);
            if let Some(rest) = t.strip_prefix("mod ") {
                let name: String = rest.chars().take_while(|&c| c.is_alphanumeric() || c == '_').collect();
                if rest[name.len()..].trim_start().starts_with(';') {
                    c.insert(name);
                }
            }
        }
        c
    };
    let _ = is_dir_module;
    let resolve = |segs: &[String]| -> Option<PathBuf> {
        let first = segs.first()?;
        let (base, rest) = match first.as_str() {
            "crate" => (Vec::new(), &segs[1..]),
            "self" => (module.to_vec(), &segs[1..]),
            "super" => {
                let ups = segs.iter().take_while(|s| *s == "super").count();
                let mut base = module.to_vec();
                for _ in 0..ups {
                    base.pop();
                }
                (base, &segs[ups..])
            }
            name if children.contains(name) => (module.to_vec(), segs),
            _ => return None,
        };
        mods.resolve(&base, rest).cloned()
    };
    let mut out = BTreeSet::new();
    // `use` statements.
    let mut from = 0;
    while let Some(p) = find(b, b"use ", from) {
        from = p + 4;
        if p > 0 && is_ident(b[p - 1]) {
            continue;
        }
        let Some(end) = b[p..].iter().position(|&c| c == b';').map(|e| p + e) else { break };
        let line_start = b[..p].iter().rposition(|&c| c == b'\n').map_or(0, |q| q + 1);
        let lead = text[line_start..p].trim();
        let reexport = lead.starts_with("pub");
        for segs in expand_use(&text[p + 4..end]) {
            // A module re-exporting its own children is their front, not their user.
            if reexport && segs.first().is_some_and(|s| children.contains(s) || s == "self") {
                continue;
            }
            if let Some(f) = resolve(&segs) {
                out.insert(f);
            }
        }
        from = end;
    }
    // Paths written inline: `crate::a::b`, `super::x`, `self::m::y`.
    for kw in [&b"crate::"[..], b"super::", b"self::"] {
        let mut from = 0;
        while let Some(p) = find(b, kw, from) {
            from = p + kw.len();
            if p > 0 && (is_ident(b[p - 1]) || b[p - 1] == b':') {
                continue;
            }
            let mut q = p;
            while q < b.len() && (is_ident(b[q]) || b[q] == b':') {
                q += 1;
            }
            let segs: Vec<String> =
                text[p..q].split("::").filter(|s| !s.is_empty()).map(String::from).collect();
            if let Some(f) = resolve(&segs) {
                out.insert(f);
            }
        }
    }
    let _ = parent;
    out.remove(file);
    out
}

/// The strongly connected groups of more than one file (Tarjan).
fn circles(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    struct T<'a> {
        edges: &'a BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        index: BTreeMap<&'a PathBuf, usize>,
        low: BTreeMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on: BTreeSet<&'a PathBuf>,
        next: usize,
        out: Vec<Vec<PathBuf>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a PathBuf) {
        t.index.insert(v, t.next);
        t.low.insert(v, t.next);
        t.next += 1;
        t.stack.push(v);
        t.on.insert(v);
        if let Some(ws) = t.edges.get(v) {
            for w in ws {
                if !t.index.contains_key(w) {
                    visit(t, w);
                    let lw = t.low[w];
                    let lv = t.low[v];
                    t.low.insert(v, lv.min(lw));
                } else if t.on.contains(w) {
                    let iw = t.index[w];
                    let lv = t.low[v];
                    t.low.insert(v, lv.min(iw));
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut group = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                group.push(w.clone());
                if w == v {
                    break;
                }
            }
            if group.len() > 1 {
                group.sort();
                t.out.push(group);
            }
        }
    }
    let mut t = T {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn no_two_files_import_each_other_directly_or_round_a_loop() {
    let root = repo();
    let mut found = Vec::new();
    for krate in crates(&root) {
        let (mods, list) = Modules::read(&krate.join("src"));
        let edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> =
            list.iter().map(|(f, m)| (f.clone(), imports(&mods, f, m))).collect();
        for group in circles(&edges) {
            let mut why = String::new();
            for a in &group {
                for b in edges[a].iter().filter(|b| group.contains(b)) {
                    let rel = |p: &Path| p.strip_prefix(&root).unwrap_or(p).display().to_string();
                    why.push_str(&format!("\n    {} -> {}", rel(a), rel(b)));
                }
            }
            found.push(why);
        }
    }
    assert!(found.is_empty(), "files that import each other, round a loop:{}", found.join("\n  and"));
}

/// Every function of a file longer than [`LONGEST`] lines without a `// Long:` reason: (name,
/// first line, lines).
fn long_functions(src: &str) -> Vec<(String, usize, usize)> {
    let text = without_tests(&blank(src));
    let b = text.as_bytes();
    let lines: Vec<&str> = src.lines().collect();
    let line_of = |i: usize| b[..i].iter().filter(|&&c| c == b'\n').count();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(p) = find(b, b"fn ", from) {
        from = p + 3;
        if p > 0 && is_ident(b[p - 1]) {
            continue;
        }
        let name: String = text[p + 3..].chars().take_while(|&c| c.is_alphanumeric() || c == '_').collect();
        if name.is_empty() {
            continue;
        }
        // The body: the first `{` outside parentheses and angle brackets, unless a `;` ends
        // the declaration first (a trait method without a body).
        let (mut depth, mut k) = (0i32, p);
        let open = loop {
            match b.get(k) {
                None => break None,
                Some(b'(') | Some(b'[') => depth += 1,
                Some(b')') | Some(b']') => depth -= 1,
                Some(b';') if depth == 0 => break None,
                Some(b'{') if depth == 0 => break Some(k),
                _ => {}
            }
            k += 1;
        };
        let Some(open) = open else { continue };
        let Some(close) = closing(b, open) else { continue };
        let (first, last) = (line_of(p), line_of(close));
        let n = last - first + 1;
        if n <= LONGEST {
            continue;
        }
        // The reason sits in the comments and attributes just above.
        let above = lines[..first].iter().rev().take_while(|l| {
            let t = l.trim_start();
            t.starts_with("//") || t.starts_with("#[")
        });
        if above.into_iter().any(|l| l.trim_start().starts_with("// Long:")) {
            continue;
        }
        out.push((name, first + 1, n));
    }
    out
}

#[test]
fn no_function_is_longer_than_150_lines_without_a_reason() {
    let root = repo();
    let mut found = Vec::new();
    for krate in crates(&root) {
        let mut list = Vec::new();
        files(&krate.join("src"), &[".rs"], &mut list);
        for f in list {
            let src = std::fs::read_to_string(&f).expect("reading a source file");
            for (name, line, n) in long_functions(&src) {
                found.push(format!(
                    "{}:{line} `{name}`: {n} lines",
                    f.strip_prefix(&root).unwrap_or(&f).display()
                ));
            }
        }
    }
    assert!(
        found.is_empty(),
        "functions over {LONGEST} lines with no `// Long:` comment saying why they must be:\n  {}",
        found.join("\n  ")
    );
}

/// The files docs/architecture.md must name: every crate's sources and build script, the
/// CUDA kernels, the fake CUDA's C, the PyTorch scripts, the protocol, the scripts and the
/// deployment files.
fn source_files(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for krate in crates(root) {
        files(&krate.join("src"), &[".rs", ".cu"], &mut out);
        if krate.join("build.rs").is_file() {
            out.push(krate.join("build.rs"));
        }
    }
    files(&root.join("testkit/fake"), &[".c", ".cpp", ".h"], &mut out);
    files(&root.join("bench/pytorch"), &[".py"], &mut out);
    files(&root.join("proto/proto"), &[".proto"], &mut out);
    files(&root.join("scripts"), &[], &mut out);
    files(&root.join("deploy"), &[], &mut out);
    out.into_iter().map(|p| p.strip_prefix(root).expect("under the repository").to_path_buf()).collect()
}

/// docs/architecture.md's paragraphs of files: a line opening with `**folder**` starts the
/// paragraph of `folder`, which runs to the next such line or heading.
fn paragraphs(doc: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in doc.lines() {
        let folder =
            line.strip_prefix("**").and_then(|r| r.split_once("**")).map(|(f, _)| f.trim_end_matches('/'));
        match folder {
            Some(f) if !f.contains(' ') => out.push((f.to_string(), format!("{line}\n"))),
            _ if line.starts_with('#') => out.push((String::new(), String::new())),
            _ => {
                if let Some(last) = out.last_mut() {
                    last.1.push_str(line);
                    last.1.push('\n');
                }
            }
        }
    }
    out.retain(|(f, _)| !f.is_empty());
    out
}

#[test]
fn the_architecture_names_every_source_file_in_its_folders_paragraph() {
    let root = repo();
    let doc =
        std::fs::read_to_string(root.join("docs/architecture.md")).expect("reading docs/architecture.md");
    let paras = paragraphs(&doc);
    let mut missing = Vec::new();
    for f in source_files(&root) {
        let path = f.to_string_lossy().into_owned();
        let named = paras.iter().any(|(folder, text)| {
            path.strip_prefix(&format!("{folder}/")).is_some_and(|rel| text.contains(&format!("`{rel}`")))
        });
        if !named {
            missing.push(path);
        }
    }
    assert!(
        missing.is_empty(),
        "docs/architecture.md does not name these files (as `path/from/the/paragraph's/folder` in the \
         paragraph that opens with **folder**):\n  {}",
        missing.join("\n  ")
    );
}

#[test]
fn the_checks_see_what_they_look_for() {
    // A circle of two files, a re-export that is not one, and a path through a child.
    let dir = tempfile::tempdir().expect("a scratch directory");
    let src = dir.path();
    std::fs::create_dir_all(src.join("a")).expect("mkdir");
    std::fs::write(src.join("lib.rs"), "mod a;\nmod b;\npub use a::X;\n").expect("write");
    std::fs::write(src.join("a/mod.rs"), "mod c;\npub use c::Y;\npub struct X;\n").expect("write");
    std::fs::write(src.join("a/c.rs"), "use super::X; // uses its parent\npub struct Y;\n").expect("write");
    std::fs::write(src.join("b.rs"), "use crate::{a::X, c};\nfn f() { let s = \"crate::b::q\"; }\n")
        .expect("write");
    let (mods, list) = Modules::read(src);
    let edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> =
        list.iter().map(|(f, m)| (f.clone(), imports(&mods, f, m))).collect();
    assert_eq!(edges[&src.join("a/c.rs")], BTreeSet::from([src.join("a/mod.rs")]));
    assert_eq!(edges[&src.join("b.rs")], BTreeSet::from([src.join("a/mod.rs"), src.join("lib.rs")]));
    assert!(edges[&src.join("a/mod.rs")].is_empty(), "a front's re-export is no import: {edges:?}");
    assert!(circles(&edges).is_empty());
    // Now a/mod.rs uses b, which uses a: a circle.
    std::fs::write(src.join("a/mod.rs"), "mod c;\npub use c::Y;\npub struct X;\nfn g() { crate::b::h(); }\n")
        .expect("write");
    let (mods, list) = Modules::read(src);
    let edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> =
        list.iter().map(|(f, m)| (f.clone(), imports(&mods, f, m))).collect();
    assert_eq!(circles(&edges), vec![vec![src.join("a/mod.rs"), src.join("b.rs")]]);

    // A long function is found, with its reason it is not; tests and strings do not count.
    let body = "    let x = 1;\n".repeat(LONGEST);
    let long = format!("fn long() {{\n{body}}}\n");
    assert_eq!(long_functions(&long), vec![("long".to_string(), 1, LONGEST + 2)]);
    assert!(long_functions(&format!("// Long: a kernel's one loop nest.\n#[inline]\n{long}")).is_empty());
    assert!(long_functions(&format!("#[cfg(test)]\nmod tests {{\n{long}}}\n")).is_empty());
    assert!(
        long_functions(&format!("#[cfg(test)]\n#[allow(clippy::unwrap_used)]\nmod tests {{\n{long}}}\n"))
            .is_empty()
    );
    let braces = format!("fn short() {{ let s = \"{{{{{{\"; let c = '{{'; }}\n{long}");
    assert_eq!(long_functions(&braces).len(), 1, "braces in literals are not code");
    assert!(long_functions(&"fn f() {\n    let x = 1;\n}\n".repeat(200)).is_empty());

    // A paragraph names files relative to its folder.
    let doc = "# A\n\n**core/src**: `lib.rs` the modules; `device/cpu.rs` the CPU.\n\n**core/src/data**: `mod.rs`.\n";
    let p = paragraphs(doc);
    assert_eq!(p.len(), 2);
    assert!(p[0].1.contains("`device/cpu.rs`") && p[1].0 == "core/src/data");
}
