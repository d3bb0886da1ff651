//! The fuzz corpus and every crash the fuzzers ever found, replayed on each test run: each input
//! goes through its target's entry point (`bca::fuzzing`), which must not panic.

use std::path::Path;

#[test]
fn every_corpus_input_and_past_crash_replays_cleanly() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut replayed = 0;
    for (name, f) in bca::fuzzing::TARGETS {
        let pack = root.join(format!("corpus/{name}.cpio"));
        let raw = std::fs::read(&pack).unwrap_or_else(|e| panic!("{}: {e}", pack.display()));
        let entries = bca::base::cpio::read(&raw).unwrap();
        assert!(!entries.is_empty(), "{name}: an empty corpus");
        for e in entries.iter().filter(|e| e.mode & 0o170000 == 0o100000) {
            f(&e.data);
            replayed += 1;
        }
        if let Ok(rd) = std::fs::read_dir(root.join(format!("regressions/{name}"))) {
            for e in rd.flatten() {
                f(&std::fs::read(e.path()).unwrap());
                replayed += 1;
            }
        }
    }
    assert!(replayed > 1000, "only {replayed} inputs replayed");
    eprintln!("{replayed} fuzz inputs replayed");
}
