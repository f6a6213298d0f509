//! The house rule inside each crate under `mover/`, checked on the source: the top-level
//! folders' floors follow the data path and no import climbs one, and in every folder of
//! every crate the modules never import each other in a circle (so any of them can
//! become a crate, and a reader can take them in order). Between crates Cargo keeps the
//! rule (docs/ARCHITECTURE.md); this test checks only what Cargo cannot say.
//!
//! Every path that begins with `crate::`, `self::` or `super::` (groups expanded) is
//! resolved to the module it names, as rustc would: an arrow goes from the file's module
//! to it, between the two children of the deepest folder they share. A name re-exported
//! at the crate root (`crate::CopyError`) counts as the module that defines it;
//! `use crate as …` would hide arrows and is refused.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each crate's folder under `mover/` and its top-level floors, lowest first (none:
/// only circles are checked).
const CRATES: &[(&str, &[&[&str]])] = &[
    (
        "engine",
        &[
            // Node state: exports, durable writes, failpoints, labels, freeze, durations.
            &["node"],
            // The block copy and what every job reports with.
            &["error", "copy", "hash"],
            // Trees, and copies to and from an agent.
            &["tree", "remote"],
            // Snapshots, and the one call behind `mover copy`.
            &["snapshot", "endpoints"],
            // What a failed job means, from the errors of all of the above.
            &["outcome"],
        ],
    ),
    (
        "node",
        &[
            // The fd store: a process of its own that keeps the agent's device connections.
            &["fd_store"],
            // Jobs that run on their own: replication, copy-on-demand, scheduled snapshots.
            &["replicate", "hydrate", "schedule"],
            // The gRPC, NBD and CSI adapters over the jobs.
            &["agent"],
        ],
    ),
    ("controller", &[]),
];

/// A module's path inside its crate (`["agent", "session"]`; the root is empty).
type ModPath = Vec<String>;

/// An arrow inside one folder: (folder, from child, to child).
type Arrow = (ModPath, String, String);

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module a file under `src` is: `a/b.rs` and `a/b/mod.rs` are `a::b`, `lib.rs`
/// the root.
fn module_of(src: &Path, file: &Path) -> ModPath {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: ModPath = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The paths of a `use` tree or an expression path starting at `s` (just after a
/// `::`), each as its segments: `a::{b, c::d}` gives `[a, b]` and `[a, c, d]`.
fn expand(s: &str, prefix: &[String], out: &mut Vec<ModPath>) {
    let s = s.trim_start();
    if let Some(group) = s.strip_prefix('{') {
        let (mut depth, mut start) = (0, 0);
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    expand(&group[start..i], prefix, out);
                    return;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(&group[start..i], prefix, out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        return;
    }
    let name = ident_at(s);
    if name.is_empty() || name == "self" {
        out.push(prefix.to_vec());
        return;
    }
    let mut path = prefix.to_vec();
    path.push(name.to_string());
    match s[name.len()..].strip_prefix("::") {
        Some(rest) => expand(rest, &path, out),
        None => out.push(path),
    }
}

/// Every module path `code` names from module `here`, resolved: `crate::a` is `[a]`,
/// `self::a` is `here + a`, `super::a` is `here`'s parent `+ a`.
fn named_paths(code: &str, here: &[String]) -> Vec<ModPath> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    for start in ["crate::", "self::", "super::"] {
        let mut from = 0;
        while let Some(i) = code[from..].find(start).map(|i| i + from) {
            from = i + start.len();
            let before = i.checked_sub(1).map(|j| bytes[j] as char);
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':' || c == '$') {
                continue; // `my_crate::`, `a::self::`, or a `super::` after `super::`
            }
            let mut base: ModPath = match start {
                "crate::" => Vec::new(),
                "self::" => here.to_vec(),
                _ => here[..here.len().saturating_sub(1)].to_vec(),
            };
            let mut rest = &code[from..];
            while let Some(r) = rest.strip_prefix("super::") {
                base.pop();
                rest = r;
            }
            expand(rest, &base, &mut out);
        }
    }
    out
}

/// Names re-exported at the crate root, each with the module that defines it.
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    for stmt in lib.split(';') {
        let Some(i) = stmt.find("pub use ") else {
            continue;
        };
        let mut paths = Vec::new();
        expand(&stmt[i + "pub use ".len()..], &[], &mut paths);
        for p in paths {
            // `a::B as C` is known by C.
            let last = p.last().cloned().unwrap_or_default();
            let alias = stmt
                .split(&format!("{last} as "))
                .nth(1)
                .map(|a| ident_at(a.trim_start()).to_string());
            map.insert(alias.unwrap_or(last), p[0].clone());
        }
    }
    map
}

/// Every arrow between sibling modules in crate `krate` (its folder under `mover/`),
/// with the files that make it.
fn import_graph(krate: &str) -> BTreeMap<Arrow, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(krate)
        .join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeSet<ModPath> = files.iter().map(|f| module_of(&src, f)).collect();
    let reexports = root_reexports(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    let mut arrows: BTreeMap<Arrow, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let rel = file
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let here = module_of(&src, file);
        let text = std::fs::read_to_string(file).unwrap();
        let code: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(
            !code.contains("crate as "),
            "{krate}/{rel}: `use crate as …` hides the arrows this test follows"
        );
        // An inline `mod tests` is a module of its own under the file's.
        let (body, tests) =
            code.split_at(code.find("#[cfg(test)]\nmod tests").unwrap_or(code.len()));
        let mut in_tests = here.clone();
        in_tests.push("tests".into());
        let named = named_paths(body, &here)
            .into_iter()
            .chain(named_paths(tests, &in_tests));
        for mut target in named {
            if target.len() == 1
                && !modules.contains(&target)
                && let Some(m) = reexports.get(&target[0])
            {
                target = vec![m.clone()];
            }
            // The module the path names: its longest prefix that is one.
            while !target.is_empty() && !modules.contains(&target) {
                target.pop();
            }
            let shared = here.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if shared < here.len() && shared < target.len() {
                let arrow = (
                    here[..shared].to_vec(),
                    here[shared].clone(),
                    target[shared].clone(),
                );
                arrows.entry(arrow).or_default().insert(rel.clone());
            }
        }
    }
    arrows
}

/// The children of a folder that reach themselves through `edges`.
fn cycles_of(edges: &BTreeSet<(String, String)>) -> Vec<String> {
    let modules: BTreeSet<&String> = edges.iter().flat_map(|(a, b)| [a, b]).collect();
    let mut cycles = Vec::new();
    for start in modules {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<&String> = vec![start];
        while let Some(m) = stack.pop() {
            for (_, to) in edges.iter().filter(|(from, _)| from == m) {
                if to == start {
                    cycles.push(format!("{start} reaches itself through {m}"));
                }
                if seen.insert(to) {
                    stack.push(to);
                }
            }
        }
    }
    cycles
}

fn floor_of(floors: &[&[&str]], module: &str) -> usize {
    floors
        .iter()
        .position(|f| f.contains(&module))
        .unwrap_or_else(|| panic!("module {module:?} is on no floor: add it to CRATES"))
}

#[test]
fn no_import_climbs_a_floor() {
    let mut climbing = Vec::new();
    for (krate, floors) in CRATES.iter().filter(|(_, f)| !f.is_empty()) {
        for ((folder, from, to), files) in import_graph(krate) {
            if folder.is_empty() && floor_of(floors, &to) > floor_of(floors, &from) {
                climbing.push(format!("{krate}: {from} -> {to} in {files:?}"));
            }
        }
    }
    assert!(
        climbing.is_empty(),
        "imports that climb a floor (docs/ARCHITECTURE.md):\n{}",
        climbing.join("\n")
    );
}

#[test]
fn no_module_imports_itself_through_its_siblings() {
    let mut all = Vec::new();
    for (krate, _) in CRATES {
        let mut by_folder: BTreeMap<ModPath, BTreeSet<(String, String)>> = BTreeMap::new();
        for ((folder, from, to), files) in import_graph(krate) {
            println!("{krate}::{} {from} -> {to} {files:?}", folder.join("::"));
            by_folder.entry(folder).or_default().insert((from, to));
        }
        for (folder, edges) in by_folder {
            for c in cycles_of(&edges) {
                all.push(format!("{krate}::{}: {c}", folder.join("::")));
            }
        }
    }
    assert!(all.is_empty(), "import circles:\n{}", all.join("\n"));
}

#[test]
fn the_graph_sees_the_imports_it_checks() {
    // The parser must find known arrows, or the checks above would pass on nothing.
    for (krate, folder, from, to) in [
        ("node", "", "agent", "replicate"),
        ("engine", "", "snapshot", "node"),
        ("engine", "", "copy", "error"),
        ("node", "agent", "transfer", "service"),
        ("node", "agent", "service", "session"),
    ] {
        let folder: ModPath = folder
            .split("::")
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        let arrow = (folder, from.to_string(), to.to_string());
        assert!(
            import_graph(krate).contains_key(&arrow),
            "{krate}: {arrow:?} not found: the parser misses imports"
        );
    }
    let circle: BTreeSet<(String, String)> = [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]
        .map(|(x, y)| (x.to_string(), y.to_string()))
        .into();
    assert_eq!(
        cycles_of(&circle).len(),
        3,
        "a circle of three is three modules reaching themselves"
    );
    let mut paths = Vec::new();
    expand("{a::{b, self}, d}; crate::e", &["x".into()], &mut paths);
    assert_eq!(paths, [vec!["x", "a", "b"], vec!["x", "a"], vec!["x", "d"]]);
    assert_eq!(
        named_paths(
            "use super::super::f; g(self::h::i); my_crate::j",
            &["m".into(), "n".into()]
        ),
        [
            vec!["m".to_string(), "n".into(), "h".into(), "i".into()],
            vec!["f".into()]
        ]
    );
}
