//! The house rule inside each crate under `mover/`: the floors follow the data path and
//! no import climbs a floor, and folders never import each other in a circle (so any of
//! them can become a crate). Between crates Cargo keeps the rule (docs/ARCHITECTURE.md):
//! this test checks only what Cargo cannot say.
//!
//! Every `crate::…` path in a crate's `src` is an arrow from its file's top-level
//! module to the module it names (a `super::` in a top-level file names the root, as
//! `crate::` does); a name re-exported at the crate root (`crate::CopyError`) counts as
//! the module that defines it. `use crate as …` would hide arrows and is refused.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each crate's folder under `mover/` and its floors, lowest first.
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
        ],
    ),
    (
        "node",
        &[
            // Jobs that run on their own: replication, copy-on-demand, scheduled snapshots.
            &["replicate", "hydrate", "schedule"],
            // The gRPC, NBD and CSI adapters over the jobs.
            &["agent"],
        ],
    ),
];

/// The floors of crate `name`.
fn floors(name: &str) -> &'static [&'static [&'static str]] {
    CRATES.iter().find(|(n, _)| *n == name).unwrap().1
}

fn floor_of(krate: &str, module: &str) -> usize {
    floors(krate)
        .iter()
        .position(|f| f.contains(&module))
        .unwrap_or_else(|| panic!("module {module:?} is on no floor: add it to FLOORS"))
}

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

/// The first identifier of each path that follows `crate::` in `code`: `crate::a::b`
/// gives `a`, `crate::{a::b, c}` gives `a` and `c`.
fn crate_paths(code: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // e.g. `my_crate::`
        }
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level items of the group, up to its matching brace.
            let (mut depth, mut start) = (0, 0);
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        names.push(first_ident(&group[start..j]));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        names.push(first_ident(&group[start..j]));
                        start = j + 1;
                    }
                    _ => {}
                }
            }
        } else {
            names.push(first_ident(rest));
        }
    }
    names.retain(|n| !n.is_empty());
    names
}

fn first_ident(s: &str) -> String {
    s.trim_start()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// Names re-exported at the crate root, each with the module that defines it.
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    let mut text = lib;
    while let Some(i) = text.find("pub use ") {
        text = &text[i + "pub use ".len()..];
        let end = text.find(';').unwrap();
        let stmt = &text[..end];
        let module = first_ident(stmt);
        let items = stmt.split_once('{').map_or_else(
            || stmt.rsplit("::").next().unwrap_or_default().to_string(),
            |(_, g)| g.trim_end_matches('}').to_string(),
        );
        for item in items.split(',') {
            // `A as B` is known by B.
            let name = item.split(" as ").last().unwrap_or_default().trim();
            if !name.is_empty() {
                map.insert(name.to_string(), module.clone());
            }
        }
        text = &text[end..];
    }
    map
}

/// Every arrow between top-level modules of crate `krate` (its folder under `mover/`):
/// (from, to) with the files that make it.
fn import_graph(krate: &str) -> BTreeMap<(String, String), BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(krate)
        .join("src");
    let reexports = root_reexports(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut arrows: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let rel = file
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if rel == "lib.rs" {
            continue;
        }
        let from = rel.split('/').next().unwrap().trim_end_matches(".rs");
        let text = std::fs::read_to_string(&file).unwrap();
        let code: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(
            !code.contains("crate as "),
            "{rel}: `use crate as …` hides the arrows this test follows"
        );
        let depth = rel.matches('/').count();
        // In a top-level file `super::` is the crate root.
        let top_level_supers = if depth == 0 {
            code.replace("super::super::", "")
                .replace("super::", "crate::")
        } else {
            String::new()
        };
        for name in crate_paths(&code)
            .into_iter()
            .chain(crate_paths(&top_level_supers))
        {
            let to = if src.join(&name).is_dir() || src.join(format!("{name}.rs")).is_file() {
                name.clone()
            } else {
                reexports.get(&name).cloned().unwrap_or_else(|| {
                    panic!("{rel}: crate::{name} is neither a module nor a root re-export")
                })
            };
            if to != from {
                arrows
                    .entry((from.to_string(), to))
                    .or_default()
                    .insert(rel.clone());
            }
        }
        // `super::super::…` from a top-level module's child leaves the module: one
        // `super::` more than the file is deep (two in its inline `mod tests`).
        let (body, tests) =
            code.split_at(code.find("#[cfg(test)]\nmod tests").unwrap_or(code.len()));
        for (part, levels) in [(body, depth + 1), (tests, depth + 2)] {
            let climbs = "super::".repeat(levels);
            assert!(
                depth == 0 || !part.contains(&climbs),
                "{rel}: {climbs} climbs out of its top-level module; name the module with crate::"
            );
        }
    }
    arrows
}

#[test]
fn no_import_climbs_a_floor() {
    let climbing: Vec<String> = CRATES
        .iter()
        .flat_map(|(krate, _)| {
            import_graph(krate)
                .into_iter()
                .filter(|((from, to), _)| floor_of(krate, to) > floor_of(krate, from))
                .map(move |((from, to), files)| format!("{krate}: {from} -> {to} in {files:?}"))
        })
        .collect();
    assert!(
        climbing.is_empty(),
        "imports that climb a floor (docs/ARCHITECTURE.md):\n{}",
        climbing.join("\n")
    );
}

#[test]
fn no_folder_imports_itself_through_others() {
    for (krate, _) in CRATES {
        let edges: BTreeSet<(String, String)> = import_graph(krate).into_keys().collect();
        assert!(
            cycles_of(&edges).is_empty(),
            "{krate}: import cycles: {:?}",
            cycles_of(&edges)
        );
    }
}

/// The modules of `edges` that reach themselves.
fn cycles_of(edges: &BTreeSet<(String, String)>) -> Vec<String> {
    // Any cycle, whatever its length, shows as a module that reaches itself.
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

#[test]
fn the_graph_sees_the_imports_it_checks() {
    // The parser must find known arrows, or the two checks above would pass on nothing.
    for (krate, from, to) in [
        ("node", "agent", "replicate"),
        ("engine", "snapshot", "node"),
        ("engine", "copy", "error"),
    ] {
        let graph = import_graph(krate);
        assert!(
            graph.contains_key(&(from.to_string(), to.to_string())),
            "{krate}: {from} -> {to} not found: the parser misses imports"
        );
    }
    assert_eq!(
        crate_paths("use crate::{a::{b, c}, d};\nlet x = crate::e::f(); my_crate::g"),
        ["a", "d", "e"]
    );
}
