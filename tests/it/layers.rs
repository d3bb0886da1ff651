//! The house's rule: `src/` is in layers (one folder each), and a layer imports only the layers
//! below it that its rule names. This reads every `crate::` path in every source file (in `use`
//! lines, grouped or not, and inline) and fails on any the rules forbid, naming the file and the
//! layer it reached. `ARCHITECTURE.md` says why each rule is there.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// `(layer, what it may import)`, top to bottom. `None`: anything (only `main.rs` imports them).
const RULES: &[(&str, Option<&[&str]>)] = &[
    ("main", None),
    ("lib", None),
    ("cli", None),
    // Test support for the fuzz targets: drives the parsers of every layer.
    ("fuzzing", None),
    (
        "daemon",
        Some(&[
            "appliance",
            "admin",
            "join",
            "edge",
            "keys",
            "pki",
            "store",
            "domain",
            "config",
            "tpm",
            "proto",
            "base",
        ]),
    ),
    (
        "appliance",
        Some(&[
            "admin", "join", "edge", "keys", "pki", "store", "domain", "config", "tpm", "proto",
            "base",
        ]),
    ),
    ("admin", Some(&["join", "store", "domain", "proto", "base"])),
    (
        "join",
        Some(&["store", "pki", "domain", "config", "tpm", "proto", "base"]),
    ),
    // The network child's code: it reaches the core only through the traits it defines.
    ("edge", Some(&["domain", "config", "proto", "base"])),
    // The machine's side: nothing of the appliance.
    ("agent", Some(&["proto", "tpm", "base"])),
    ("keys", Some(&["pki", "tpm", "config", "base"])),
    ("store", Some(&["domain", "base"])),
    ("pki", Some(&["config", "proto", "base"])),
    ("domain", Some(&["proto", "base"])),
    ("tpm", Some(&["base"])),
    ("config", Some(&["base"])),
    ("proto", Some(&["base"])),
    ("base", Some(&[])),
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The layer a file belongs to: its folder under `src/`, or its own name at the top.
fn layer_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// Every top-level module a text names through `crate::`: `crate::x::…`, `use crate::x;` and
/// each item of `use crate::{x::…, y, …}`.
fn named_layers(text: &str) -> BTreeSet<String> {
    named_after(text, "crate::")
}

/// Every module a text names right after `prefix` (a path ending in `::`), grouped or not.
fn named_after(text: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (i, _) in text.match_indices(prefix) {
        // `bca::` is not `crate::`, but `somecrate::` must not count.
        let before = text[..i].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &text[i + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // A group: every item at depth 0 names a module.
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => {
                        depth += 1;
                        item.push(c);
                    }
                    '}' if depth == 0 => break,
                    '}' => {
                        depth -= 1;
                        item.push(c);
                    }
                    ',' if depth == 0 => {
                        out.insert(ident(item.trim()));
                        item.clear();
                    }
                    c => item.push(c),
                }
            }
            if !item.trim().is_empty() {
                out.insert(ident(item.trim()));
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out.remove("");
    out
}

/// Every import the rules forbid, as `(file, layer it names)`.
fn violations(src: &Path) -> Vec<(String, String)> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let mut bad = Vec::new();
    for f in files {
        let layer = layer_of(src, &f);
        let Some((_, rule)) = RULES.iter().find(|(l, _)| *l == layer) else {
            bad.push((
                f.display().to_string(),
                format!("(a layer with no rule: {layer})"),
            ));
            continue;
        };
        let Some(may) = rule else { continue };
        let text = std::fs::read_to_string(&f).unwrap();
        for named in named_layers(&text) {
            if named != layer && !may.contains(&named.as_str()) {
                bad.push((f.display().to_string(), named));
            }
        }
    }
    bad.sort();
    bad
}

#[test]
fn every_import_keeps_to_the_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let bad = violations(&src);
    assert!(
        bad.is_empty(),
        "imports the layers forbid (file -> layer; see ARCHITECTURE.md, \"Layers\"):\n{}",
        bad.iter()
            .map(|(f, l)| format!("  {f} -> {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The reader itself: it sees every way a path is written, and an upward import fails.
#[test]
fn the_layer_reader_sees_grouped_nested_and_inline_paths() {
    let text = "use crate::base::clock;\nuse crate::{proto::{self, claims}, domain::token::Expect, base};\n\
                fn f() { crate::edge::http::x(); let s = \"notcrate::join\"; }\n";
    let got: Vec<String> = named_layers(text).into_iter().collect();
    assert_eq!(got, ["base", "domain", "edge", "proto"]);
    let inside: Vec<String> = named_after(
        "use crate::join::{issue::Ready, service};\nfn f() { crate::join::tpm::x(); }\n",
        "crate::join::",
    )
    .into_iter()
    .collect();
    assert_eq!(inside, ["issue", "service", "tpm"]);

    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("base")).unwrap();
    std::fs::create_dir_all(src.join("edge")).unwrap();
    std::fs::write(src.join("base/mod.rs"), "pub mod clock;\n").unwrap();
    std::fs::write(src.join("edge/mod.rs"), "use crate::base::clock;\n").unwrap();
    assert!(violations(&src).is_empty());
    // The edge reaching the store, and the ground floor reaching up: both named.
    std::fs::write(
        src.join("edge/http.rs"),
        "fn f() { crate::store::Store::open(); }\n",
    )
    .unwrap();
    std::fs::write(src.join("base/clock.rs"), "use crate::{edge};\n").unwrap();
    let bad = violations(&src);
    assert_eq!(bad.len(), 2, "{bad:?}");
    assert!(bad[0].0.ends_with("base/clock.rs") && bad[0].1 == "edge");
    assert!(bad[1].0.ends_with("edge/http.rs") && bad[1].1 == "store");
    // A folder the rules do not know is refused too.
    std::fs::create_dir_all(src.join("misc")).unwrap();
    std::fs::write(src.join("misc/mod.rs"), "").unwrap();
    assert!(violations(&src)
        .iter()
        .any(|(_, l)| l.contains("no rule: misc")));
}

/// Inside the join layer: the attestors (and renewal and the session rows) share the kernel
/// (`issue`), the admission writer (`admit`), acceptance (after an admission, at a `Hello`), the
/// join requests and the site, and never import each other or the service that dispatches to
/// them.
#[test]
fn the_attestors_never_import_each_other() {
    let join = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/join");
    let shared = ["issue", "admit", "acceptance", "requests", "site"];
    let attestors = [
        "token",
        "discovery",
        "tpm",
        "x509pop",
        "renewal",
        "sessions",
    ];
    let mut bad = Vec::new();
    for a in attestors {
        let text = std::fs::read_to_string(join.join(format!("{a}.rs"))).unwrap();
        for m in named_after(&text, "crate::join::") {
            if m != a && !shared.contains(&m.as_str()) {
                bad.push(format!("src/join/{a}.rs -> join::{m}"));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// What names the database engine in a source text: the `rusqlite` crate, or SQL (a statement's
/// opening words, in any case, with what follows them).
fn engine_words(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    if text.contains("rusqlite") {
        found.push("rusqlite".to_string());
    }
    let upper = text.to_ascii_uppercase();
    let words: Vec<&str> = upper
        .split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
        .filter(|w| !w.is_empty())
        .collect();
    for w in words.windows(4) {
        let sql = matches!(
            w,
            ["SELECT", _, "FROM", _]
                | ["INSERT", "INTO", _, _]
                | ["DELETE", "FROM", _, "WHERE"]
                | ["UPDATE", _, "SET", _]
                | ["PRAGMA", _, _, _]
        );
        if sql {
            found.push(w.join(" "));
        }
    }
    found
}

/// The one storage interface: above `src/store/`, no code names the engine or writes SQL; it
/// calls the store's operations on `store::Tx`, so a second engine slots in behind them.
#[test]
fn no_code_above_the_store_names_the_engine_or_writes_sql() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut bad = Vec::new();
    for f in files {
        if layer_of(&src, &f) == "store" {
            continue;
        }
        for w in engine_words(&std::fs::read_to_string(&f).unwrap()) {
            bad.push(format!("  {} -> {w}", f.display()));
        }
    }
    assert!(
        bad.is_empty(),
        "the engine named above the store (see ARCHITECTURE.md, \"Boundaries\"):\n{}",
        bad.join("\n")
    );
}

/// The reader of engine words finds what would break the rule, and passes prose.
#[test]
fn the_engine_reader_sees_sql_and_the_crate() {
    let leaks = engine_words(
        "use rusqlite::params;\nfn f(tx: &T) { tx.execute(\"update nodes set state = 'x'\", []); }\n\
         const Q: &str = \"SELECT id FROM tenants\";\n",
    );
    assert_eq!(
        leaks,
        [
            "rusqlite",
            "UPDATE NODES SET STATE",
            "SELECT ID FROM TENANTS"
        ]
    );
    assert!(
        engine_words("//! Select a pool from the list; update the node, then set it.\n").is_empty()
    );
}
