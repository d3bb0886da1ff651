//! Install: the Debian package (`scripts/build-deb.sh`) and `make install` put the binary, the
//! hardened unit, the sysusers.d entry, completions, the man page and the state directory where
//! they belong, with their modes; the unit passes `systemd-analyze verify`.

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const EPOCH: i64 = 1_700_000_000;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_bca")
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .permissions()
        .mode()
        & 0o7777
}

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Every regular file under `root`, relative, with its mode.
fn files_under(root: &Path) -> BTreeMap<String, u32> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, u32>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                walk(root, &p, out);
            } else {
                let rel = p.strip_prefix(root).unwrap().display().to_string();
                out.insert(rel, m.permissions().mode() & 0o7777);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// The lines of a script or config file that are not blank or comments.
fn code(s: &str) -> Vec<&str> {
    s.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

/// The unit's settings (no comments, blank lines or section headers).
fn settings(unit: &str) -> Vec<&str> {
    code(unit)
        .into_iter()
        .filter(|l| !l.starts_with('['))
        .collect()
}

fn assert_hardened(unit: &str, exec: &str) {
    let lines = settings(unit);
    let exec_start = format!("ExecStart={exec} serve --state-dir /var/lib/bca");
    for want in [
        exec_start.as_str(),
        "User=bca",
        "Group=bca",
        "SupplementaryGroups=tss",
        "AmbientCapabilities=CAP_NET_BIND_SERVICE",
        "CapabilityBoundingSet=CAP_NET_BIND_SERVICE",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "StateDirectory=bca",
        "StateDirectoryMode=0700",
        "ReadWritePaths=/var/lib/bca",
        "DevicePolicy=closed",
        "DeviceAllow=/dev/tpmrm0 rw",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "MemoryDenyWriteExecute=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service seccomp landlock_create_ruleset landlock_add_rule landlock_restrict_self",
        "UMask=0077",
        "Restart=on-failure",
        "KillSignal=SIGTERM",
        "EnvironmentFile=-/etc/bca/secret.env",
        "WantedBy=multi-user.target",
    ] {
        assert!(lines.contains(&want), "the unit lacks {want:?}:\n{unit}");
    }
    // One capability, granted and bounded, and no other anywhere in the settings.
    for l in &lines {
        for word in l.split(|c: char| c == '=' || c.is_whitespace()) {
            if word.starts_with("CAP_") {
                assert_eq!(
                    word, "CAP_NET_BIND_SERVICE",
                    "unexpected capability in {l:?}"
                );
            }
        }
    }
    // Nothing that runs it as root or undoes the hardening; every key set once (a second line
    // could quietly override the first).
    let mut keys = std::collections::HashSet::new();
    for l in &lines {
        let (k, v) = l
            .split_once('=')
            .unwrap_or_else(|| panic!("not a setting: {l:?}"));
        assert!(keys.insert(k), "{k} is set twice");
        assert!(!(k == "User" && v == "root"), "runs as root");
        // PrivateDevices=yes would hide /dev/tpmrm0; DevicePolicy=closed does the confining.
        assert!(!(k == "PrivateDevices" && v != "no"), "{l}");
        assert!(
            !matches!(
                (k, v),
                ("NoNewPrivileges", "no") | ("ProtectSystem", "no") | ("ProtectSystem", "false")
            ),
            "{l}"
        );
        assert!(!v.contains("AF_PACKET") && !v.contains("AF_NETLINK"), "{l}");
        // The network child must be able to confine itself under the unit's filter.
        if k == "SystemCallFilter" {
            for call in [
                "seccomp",
                "landlock_create_ruleset",
                "landlock_restrict_self",
            ] {
                assert!(
                    v.split_whitespace().any(|w| w == call),
                    "{call} missing: {l}"
                );
            }
        }
    }
    assert!(keys.contains("SystemCallFilter"));
}

/// `systemd-analyze verify` on the unit inside `root`, against the host's own units (copied into
/// the root, since `--root` looks every dependency up there). Unknown keys or a bad value are only
/// warnings to systemd, so any line naming bca.service fails the test too. `make test` installs
/// systemd-analyze (scripts/install-deps.sh); without it the test fails rather than pass unchecked.
fn verify_unit(root: &Path, unit_path: &str) {
    assert!(
        have("systemd-analyze"),
        "systemd-analyze is not installed (scripts/install-deps.sh installs it)"
    );
    let host_units = ["/usr/lib/systemd/system", "/lib/systemd/system"]
        .into_iter()
        .find(|d| Path::new(d).join("sysinit.target").exists())
        .expect("systemd-analyze is installed but no sysinit.target was found");
    let units = root.join("usr/lib/systemd/system");
    std::fs::create_dir_all(&units).unwrap();
    run(Command::new("cp")
        .arg("-an")
        .arg(format!("{host_units}/."))
        .arg(&units));
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(format!("--root={}", root.display()))
        .arg(unit_path)
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "systemd-analyze verify {unit_path} failed:\n{all}"
    );
    assert!(
        !all.contains("bca.service"),
        "systemd-analyze verify warned about the unit:\n{all}"
    );
}

/// The maintainer script with the commands that touch the system replaced by stubs that log their
/// arguments; `DPKG_ROOT` points the state directory into `root`.
fn run_postinst(
    postinst: &Path,
    root: &Path,
    stubs: &Path,
    log: &Path,
    users_exist: bool,
) -> String {
    std::fs::create_dir_all(stubs).unwrap();
    let getent_rc = if users_exist { 0 } else { 2 };
    let id_groups = if users_exist { "bca tss" } else { "bca" };
    let stub = |name: &str, body: &str| {
        let p = stubs.join(name);
        std::fs::write(
            &p,
            format!("#!/bin/sh\necho \"{name} $*\" >> \"$LOG\"\n{body}\n"),
        )
        .unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    stub("getent", &format!("exit {getent_rc}"));
    stub("id", &format!("echo '{id_groups}'"));
    for name in [
        "adduser",
        "addgroup",
        "chown",
        "systemctl",
        "systemd-sysusers",
        "useradd",
    ] {
        stub(name, "exit 0");
    }
    let _ = std::fs::remove_file(log);
    let out = run(Command::new("sh")
        .arg(postinst)
        .args(["configure", ""])
        .env(
            "PATH",
            format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", stubs.display()),
        )
        .env("DPKG_ROOT", root)
        .env("LOG", log));
    assert!(
        text(&out).contains("bca init"),
        "the first install says what to do next"
    );
    std::fs::read_to_string(log).unwrap_or_default()
}

#[test]
fn the_debian_package_installs_the_files_modes_and_a_hardened_unit() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("out");
    let version = env!("CARGO_PKG_VERSION");

    let built = run(Command::new("bash")
        .arg(repo().join("scripts/build-deb.sh"))
        .arg(bin())
        .arg(&out_dir)
        .env("BCA_DEB_COMPRESSION", "none")
        .env("SOURCE_DATE_EPOCH", EPOCH.to_string()));
    let deb = out_dir.join(format!("bca_{version}_amd64.deb"));
    assert_eq!(text(&built).trim(), deb.display().to_string());

    let info = text(&run(Command::new("dpkg-deb").arg("-I").arg(&deb)));
    for want in [
        "Package: bca".to_string(),
        format!("Version: {version}"),
        "Architecture: amd64".into(),
        "Maintainer: ".into(),
        "Description: ".into(),
        "postinst".into(),
        "prerm".into(),
        "postrm".into(),
        "md5sums".into(),
    ] {
        assert!(info.contains(&want), "dpkg-deb -I lacks {want:?}:\n{info}");
    }
    // Owned by root in the archive, whoever built it.
    let listing = text(&run(Command::new("dpkg-deb").arg("-c").arg(&deb)));
    for l in listing.lines() {
        assert!(l.contains(" root/root "), "not root-owned: {l}");
    }

    let root = tmp.path().join("root");
    run(Command::new("dpkg").arg("-x").arg(&deb).arg(&root));
    let expected: BTreeMap<String, u32> = [
        ("usr/bin/bca", 0o755),
        ("lib/systemd/system/bca.service", 0o644),
        ("usr/lib/sysusers.d/bca.conf", 0o644),
        ("usr/share/bash-completion/completions/bca", 0o644),
        ("usr/share/zsh/vendor-completions/_bca", 0o644),
        ("usr/share/fish/vendor_completions.d/bca.fish", 0o644),
        ("usr/share/man/man1/bca.1.gz", 0o644),
        ("usr/share/doc/bca/copyright", 0o644),
        ("usr/share/doc/bca/install.md", 0o644),
    ]
    .into_iter()
    .map(|(p, m)| (p.to_string(), m))
    .collect();
    assert_eq!(
        files_under(&root),
        expected,
        "the package's files and modes"
    );
    for d in ["usr", "usr/bin", "lib/systemd/system", "usr/share/man/man1"] {
        assert_eq!(mode(&root.join(d)), 0o755, "{d}");
    }
    // Reproducible: every mtime is SOURCE_DATE_EPOCH.
    for f in expected.keys() {
        assert_eq!(
            std::fs::metadata(root.join(f)).unwrap().mtime(),
            EPOCH,
            "{f}"
        );
    }

    // The binary is the one given, byte for byte; the generated files are what it prints.
    run(Command::new("cmp").arg(bin()).arg(root.join("usr/bin/bca")));
    let man = text(&run(Command::new("gzip")
        .arg("-dc")
        .arg(root.join("usr/share/man/man1/bca.1.gz"))));
    assert!(
        man.lines().any(|l| l.starts_with(".TH bca 1")),
        "not roff:\n{man}"
    );
    let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap();
    assert!(read("usr/share/bash-completion/completions/bca").contains("_bca()"));
    assert!(read("usr/share/zsh/vendor-completions/_bca").starts_with("#compdef bca"));
    assert!(read("usr/share/fish/vendor_completions.d/bca.fish").contains("complete -c bca"));
    let sysusers = read("usr/lib/sysusers.d/bca.conf");
    assert!(
        settings(&sysusers).contains(&"u bca - \"bca appliance\" /var/lib/bca /usr/sbin/nologin")
    );
    assert!(settings(&sysusers).contains(&"m bca tss"));
    assert!(read("usr/share/doc/bca/copyright").contains("License: Apache-2.0"));

    let unit = read("lib/systemd/system/bca.service");
    assert_hardened(&unit, "/usr/bin/bca");

    // The control area: md5sums match the files; the maintainer scripts parse.
    let control = tmp.path().join("control");
    run(Command::new("dpkg-deb").arg("-e").arg(&deb).arg(&control));
    run(Command::new("md5sum")
        .args(["-c", "--quiet"])
        .arg(control.join("md5sums"))
        .current_dir(&root));
    for s in ["postinst", "prerm", "postrm"] {
        assert_eq!(mode(&control.join(s)), 0o755, "{s}");
        run(Command::new("sh").arg("-n").arg(control.join(s)));
    }
    // Purge keeps the state directory: no line of postrm deletes it.
    let postrm = std::fs::read_to_string(control.join("postrm")).unwrap();
    for l in code(&postrm) {
        assert!(
            !(l.contains("rm ") && l.contains("/var/lib/bca")),
            "postrm deletes state: {l}"
        );
    }
    // No script starts, restarts or enables the service (the operator runs `bca init` first).
    for s in ["postinst", "prerm", "postrm"] {
        let script = std::fs::read_to_string(control.join(s)).unwrap();
        for l in code(&script)
            .into_iter()
            .filter(|l| !l.starts_with("echo "))
        {
            for verb in [
                "start",
                "restart",
                "enable",
                "try-restart",
                "reload-or-restart",
            ] {
                assert!(!l.contains(&format!("systemctl {verb}")), "{s}: {l}");
            }
            assert!(!l.contains("deb-systemd-invoke"), "{s}: {l}");
        }
    }

    // The postinst on a fresh system: the groups and the user made, the state directory 0700 and
    // handed to bca.
    let fake = tmp.path().join("fake-root");
    let stubs = tmp.path().join("stubs");
    let log = tmp.path().join("log");
    let calls = run_postinst(&control.join("postinst"), &fake, &stubs, &log, false);
    let state = fake.join("var/lib/bca");
    assert_eq!(mode(&state), 0o700);
    for want in [
        "addgroup --system tss".to_string(),
        "adduser --system --group --home /var/lib/bca --no-create-home --shell /usr/sbin/nologin --gecos bca appliance bca".into(),
        "adduser --quiet bca tss".into(),
        format!("chown bca:bca {}", state.display()),
    ] {
        assert!(calls.lines().any(|l| l == want), "postinst did not run {want:?}:\n{calls}");
    }
    // Again, with the users there and the directory left loose: nothing re-created, mode restored.
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
    let calls = run_postinst(&control.join("postinst"), &fake, &stubs, &log, true);
    assert_eq!(mode(&state), 0o700);
    assert!(
        !calls.contains("adduser") && !calls.contains("addgroup"),
        "{calls}"
    );

    verify_unit(&root, "/lib/systemd/system/bca.service");
}

#[test]
fn make_install_stages_the_tree_without_building() {
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("dest");
    let make = |extra: &[&str]| {
        let mut c = Command::new("make");
        c.arg("-C")
            .arg(repo())
            .arg("--no-print-directory")
            .args(extra)
            .arg(format!("BIN={}", bin()))
            .arg(format!("DESTDIR={}", dest.display()))
            .arg("PREFIX=/usr/local");
        // A parent make (`make test`) must not pass its variables down.
        for v in [
            "MAKEFLAGS",
            "MFLAGS",
            "MAKELEVEL",
            "BINDIR",
            "UNITDIR",
            "MANDIR",
            "ZSHDIR",
            "SYSUSERSDIR",
            "BASHDIR",
            "FISHDIR",
        ] {
            c.env_remove(v);
        }
        c
    };
    // With BIN, `install` does not depend on `build`: no cargo.
    let plan = text(&run(&mut make(&["-n", "install"])));
    assert!(
        !plan.contains("cargo"),
        "make install BIN=… would build:\n{plan}"
    );

    run(&mut make(&["install"]));
    let expected: BTreeMap<String, u32> = [
        ("usr/local/bin/bca", 0o755),
        ("usr/local/lib/systemd/system/bca.service", 0o644),
        ("usr/local/lib/sysusers.d/bca.conf", 0o644),
        ("usr/local/share/bash-completion/completions/bca", 0o644),
        ("usr/local/share/zsh/site-functions/_bca", 0o644),
        ("usr/local/share/fish/vendor_completions.d/bca.fish", 0o644),
        ("usr/local/share/man/man1/bca.1.gz", 0o644),
    ]
    .into_iter()
    .map(|(p, m)| (p.to_string(), m))
    .collect();
    assert_eq!(
        files_under(&dest),
        expected,
        "make install's files and modes"
    );
    assert_eq!(mode(&dest.join("var/lib/bca")), 0o700);
    run(Command::new("cmp")
        .arg(bin())
        .arg(dest.join("usr/local/bin/bca")));
    let man = text(&run(Command::new("gzip")
        .arg("-dc")
        .arg(dest.join("usr/local/share/man/man1/bca.1.gz"))));
    assert!(man.lines().any(|l| l.starts_with(".TH bca 1")));

    // The package's unit but for the binary's path.
    let unit =
        std::fs::read_to_string(dest.join("usr/local/lib/systemd/system/bca.service")).unwrap();
    assert_hardened(&unit, "/usr/local/bin/bca");
    let shipped = std::fs::read_to_string(repo().join("packaging/bca.service")).unwrap();
    assert_eq!(
        unit,
        shipped.replace("ExecStart=/usr/bin/bca ", "ExecStart=/usr/local/bin/bca ")
    );
    verify_unit(&dest, "/usr/local/lib/systemd/system/bca.service");
}
