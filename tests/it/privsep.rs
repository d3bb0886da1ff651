//! Privilege separation: the gateway's network child holds no private key, cannot open the key
//! files or the database, runs confined, and killing it loses nothing.

use crate::common::*;
use serde_json::json;
use std::path::{Path, PathBuf};

/// The pid of `serve`'s network child.
fn net_child(a: &Appliance) -> u32 {
    net_child_of(a.child.as_ref().unwrap().id())
}

fn net_child_of(parent: u32) -> u32 {
    wait_for("the network child", 20, || {
        let tasks = std::fs::read_dir(format!("/proc/{parent}/task")).ok()?;
        tasks
            .flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
            .flat_map(|c| {
                c.split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok())
                    .collect::<Vec<_>>()
            })
            .find(|p| {
                std::fs::read(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| c.split(|b| *b == 0).any(|w| w == b"net-child"))
            })
    })
}

fn status_field(pid: u32, field: &str) -> String {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        .trim()
        .to_string()
}

/// The 32-byte private scalars of every key in `keys/keys.json` (PKCS#8 P-256: the
/// ECPrivateKey's `02 01 01 04 20 <scalar>`).
fn private_scalars(state: &Path) -> Vec<(String, Vec<u8>)> {
    let keys: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state.join("keys/keys.json")).unwrap()).unwrap();
    let mut v = Vec::new();
    for (name, val) in keys.as_object().unwrap() {
        let Some(der) = val.as_str().and_then(bca::base::crypto::b64_decode) else {
            continue;
        };
        let at = der
            .windows(5)
            .position(|w| w == [0x02, 0x01, 0x01, 0x04, 0x20])
            .unwrap_or_else(|| panic!("{name}: no EC private key"));
        v.push((name.clone(), der[at + 5..at + 37].to_vec()));
    }
    assert!(v.len() >= 4, "keys.json names {} keys", v.len());
    v
}

/// Which of `needles` (in either byte order: aws-lc keeps a scalar as little-endian words)
/// appear in a readable mapping of the process's memory, and how many bytes were searched.
fn search_memory(pid: u32, needles: &[Vec<u8>]) -> (Vec<bool>, usize) {
    use std::io::{Read, Seek, SeekFrom};
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let mut mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let mut found = vec![false; needles.len()];
    let mut total = 0;
    let mut buf = Vec::new();
    for l in maps.lines() {
        let mut f = l.split_whitespace();
        let (range, perms) = (f.next().unwrap(), f.next().unwrap());
        if !perms.starts_with('r') || l.ends_with("[vvar]") || l.ends_with("[vsyscall]") {
            continue;
        }
        let (lo, hi) = range.split_once('-').unwrap();
        let (lo, hi) = (
            u64::from_str_radix(lo, 16).unwrap(),
            u64::from_str_radix(hi, 16).unwrap(),
        );
        buf.resize((hi - lo) as usize, 0);
        if mem.seek(SeekFrom::Start(lo)).is_err() || mem.read_exact(&mut buf).is_err() {
            continue;
        }
        total += buf.len();
        for (n, hit) in needles.iter().zip(found.iter_mut()) {
            let rev: Vec<u8> = n.iter().rev().copied().collect();
            *hit |= contains(&buf, n) || contains(&buf, &rev);
        }
    }
    (found, total)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    memchr::memmem::find(hay, needle).is_some()
}

#[test]
fn the_network_child_is_confined_and_holds_no_key() {
    let a = Appliance::start();
    let pool = a.pool("p1");
    let (_, token) = a.token(&pool, json!({"maxUses": 5}));
    // A join and a renewal-capable identity: the child has done a handshake with the key.
    Sim::new(&a).admitted(&token, &machine());
    let child = net_child(&a);
    let parent = a.child.as_ref().unwrap().id();

    // Another user, no capabilities, no new privileges, a seccomp filter.
    let uid = status_field(child, "Uid");
    assert!(
        uid.split_whitespace().all(|u| u == "65534"),
        "child uids: {uid}"
    );
    assert!(status_field(child, "Gid")
        .split_whitespace()
        .all(|g| g == "65534"));
    assert_eq!(status_field(child, "Groups"), "65534");
    assert_eq!(status_field(child, "CapEff"), "0000000000000000");
    assert_eq!(status_field(child, "CapPrm"), "0000000000000000");
    assert_eq!(status_field(child, "NoNewPrivs"), "1");
    assert_eq!(status_field(child, "Seccomp"), "2");
    // Not dumpable (it holds the session-ticket keys): its /proc files are root's, not its user's.
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        std::fs::metadata(format!("/proc/{child}/status"))
            .unwrap()
            .uid(),
        0
    );

    // Of the state directory it holds two directories, read-only: the boot root and the
    // downloads. No database, no key file, no config.
    let state = std::fs::canonicalize(a.state()).unwrap();
    let fds: Vec<(PathBuf, String)> = std::fs::read_dir(format!("/proc/{child}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let target = std::fs::read_link(e.path()).ok()?;
            let info = std::fs::read_to_string(format!(
                "/proc/{child}/fdinfo/{}",
                e.file_name().to_string_lossy()
            ))
            .ok()?;
            let flags = info
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))?
                .trim()
                .to_string();
            Some((target, flags))
        })
        .collect();
    let inside: Vec<&(PathBuf, String)> =
        fds.iter().filter(|(f, _)| f.starts_with(&state)).collect();
    let mut names: Vec<PathBuf> = inside.iter().map(|(f, _)| f.clone()).collect();
    names.sort();
    assert_eq!(
        names,
        vec![state.join("boot"), state.join("downloads")],
        "the child holds {fds:?}"
    );
    for (f, flags) in inside {
        // O_ACCMODE is O_RDONLY (octal flags).
        let mode = u32::from_str_radix(flags, 8).unwrap() & 0o3;
        assert_eq!(mode, 0, "{} is open with flags {flags}", f.display());
    }
    let fds: Vec<PathBuf> = fds.into_iter().map(|(f, _)| f).collect();
    assert!(fds
        .iter()
        .any(|f| f.to_string_lossy().starts_with("socket:")));

    // No private key in its memory; the same search finds the gateway key in the parent's.
    let scalars = private_scalars(&a.state());
    let needles: Vec<Vec<u8>> = scalars.iter().map(|(_, s)| s.clone()).collect();
    let (in_child, searched) = search_memory(child, &needles);
    assert!(searched > 1 << 20, "searched {searched} bytes of the child");
    for ((name, _), hit) in scalars.iter().zip(&in_child) {
        assert!(!hit, "the network child's memory holds the {name} key");
    }
    let (in_parent, _) = search_memory(parent, &needles);
    let gw = scalars
        .iter()
        .position(|(n, _)| n.to_lowercase().contains("gateway"))
        .expect("a gateway key");
    assert!(
        in_parent[gw],
        "the search did not find the gateway key where it is"
    );

    // The child itself tried to open the keys and the database and was refused (the parent
    // would not serve otherwise); the log says so.
    let mut a = a;
    a.stop();
    let err = tempfile::NamedTempFile::new().unwrap();
    a.serve_logging(
        PASSPHRASE,
        "127.0.0.1:0",
        "127.0.0.1:0",
        "bca::daemon::privsep=debug,warn",
        std::process::Stdio::from(err.reopen().unwrap()),
    );
    Sim::new(&a).admitted(&token, &machine());
    a.stop();
    let log = std::fs::read_to_string(err.path()).unwrap();
    assert!(log.contains("the network child is confined"), "{log}");
    let keys = state.join("keys/keys.json");
    let probe = log
        .lines()
        .find(|l| l.contains("privsep: probe") && l.contains(keys.to_str().unwrap()))
        .unwrap_or_else(|| panic!("no probe of {}: {log}", keys.display()));
    assert!(probe.contains("Permission denied"), "{probe}");
    let db_probe = log
        .lines()
        .find(|l| l.contains("privsep: probe") && l.contains("bca.db"))
        .unwrap();
    assert!(db_probe.contains("Permission denied"), "{db_probe}");
}

#[test]
fn killing_the_network_child_loses_nothing_and_it_is_restarted() {
    let a = Appliance::start();
    let pool = a.pool("p1");
    let (t, token) = a.token(&pool, json!({"maxUses": 10}));
    let dir = joined_agent_dir(&a, &token);
    let mut agent = agent_run(&dir);
    wait_for("the session", 30, || (connected(&a) == 1).then_some(()));
    let sim = Sim::new(&a);
    for _ in 0..3 {
        sim.admitted(&token, &machine());
    }
    let nodes_before = a.count("SELECT COUNT(*) FROM nodes");
    let certs_before = a.count("SELECT COUNT(*) FROM node_certs");
    let first = net_child(&a);
    let parent = a.child.as_ref().unwrap().id();

    let _ = std::process::Command::new("kill")
        .args(["-KILL", &first.to_string()])
        .status();
    // A join sent while no child runs waits in the listener's backlog and is answered.
    let body = sim.admitted(&token, &machine());
    assert!(!body.certificate_chain.is_empty());

    let second = net_child(&a);
    assert_ne!(first, second);
    assert_eq!(a.child.as_ref().unwrap().id(), parent);
    assert!(std::path::Path::new(&format!("/proc/{parent}")).exists());
    assert_eq!(status_field(second, "Seccomp"), "2");
    // Nothing committed was lost; the new join is there too.
    assert_eq!(a.count("SELECT COUNT(*) FROM nodes"), nodes_before + 1);
    assert_eq!(a.count("SELECT COUNT(*) FROM node_certs"), certs_before + 1);
    assert_eq!(a.uses_left(t["id"].as_str().unwrap()), 10 - 5);
    let ok: String = a
        .db()
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(ok, "ok");
    // The session the child held was recorded closed, and the agent came back.
    assert!(a.last_event("node.disconnected").is_some());
    wait_for("the agent back in session", 30, || {
        (connected(&a) == 1).then_some(())
    });
    let (_, metrics) = curl(&a, "/metrics", "GET");
    assert!(
        metrics.contains("bca_privsep_child_restarts_total 1"),
        "{metrics}"
    );
    // Two gateway rotations, then a child restart: the new child serves the current leaf (the
    // parent signs only for the current and the previous one).
    for _ in 0..2 {
        let o = a.cli(&["pki", "rotate", "gateway"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let third = net_child(&a);
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &third.to_string()])
        .status();
    wait_for("a new child", 20, || (net_child(&a) != third).then_some(()));
    sim.admitted(&token, &machine());
    let _ = agent.kill();
    let _ = agent.wait();
}

#[test]
fn a_privsep_user_that_cannot_be_used_is_a_clear_error() {
    for (user, says) in [("no-such-user-here", "does not exist"), ("root", "is root")] {
        let (dir, out) = init_dir("file", &[]);
        assert!(out.status.success());
        let state = dir.path().join("state");
        let cfg = state.join("config.toml");
        let text = std::fs::read_to_string(&cfg).unwrap();
        let section = format!("[privsep]\nenabled = true\nuser = \"{user}\"\n");
        std::fs::write(&cfg, replace_table(&text, "privsep", &section)).unwrap();
        let before = sha256_file_tree(&state);
        let out = serve_exit(&state, PASSPHRASE);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            err.contains("INVALID_CONFIG") && err.contains(says),
            "{err}"
        );
        assert!(err.contains("[privsep] user"), "{err}");
        // Only the database's -shm/-wal may differ: nothing of ours changed.
        let after = sha256_file_tree(&state);
        let keep = |v: &Vec<(PathBuf, String, u32)>| -> Vec<(PathBuf, String, u32)> {
            v.iter()
                .filter(|(p, _, _)| {
                    let s = p.to_string_lossy();
                    !s.ends_with("-shm") && !s.ends_with("-wal") && !s.ends_with("bca.db")
                })
                .cloned()
                .collect()
        };
        assert_eq!(keep(&before), keep(&after));
    }
}

#[test]
fn dhcp_tftp_and_http_are_parsed_in_the_child_and_survive_its_death() {
    let (a, proxy, tftp) = crate::boot::boot_appliance_with("proxy", true);
    let child = net_child(&a);
    let fetch = |name: &str| {
        std::process::Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "3",
                &format!("tftp://127.0.0.1:{tftp}/{name}"),
            ])
            .output()
            .unwrap()
    };
    assert!(fetch("snponly.efi").status.success());
    // A frozen child answers nothing: the key-holding parent reads no DHCP, TFTP or HTTP.
    let signal = |sig: &str, pid: u32| {
        assert!(std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap()
            .success());
    };
    signal("-STOP", child);
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_millis(1500)))
        .unwrap();
    let mut req = Vec::new();
    {
        use dhcproto::{Encodable, Encoder};
        let mut m = dhcproto::v4::Message::default();
        m.set_opcode(dhcproto::v4::Opcode::BootRequest)
            .set_xid(0x5eed)
            .set_chaddr(&[0x52, 0x54, 0, 0x12, 0x34, 0x56]);
        m.opts_mut().insert(dhcproto::v4::DhcpOption::MessageType(
            dhcproto::v4::MessageType::Request,
        ));
        m.opts_mut()
            .insert(dhcproto::v4::DhcpOption::ClassIdentifier(
                b"PXEClient:Arch:00007:UNDI:003016".to_vec(),
            ));
        m.opts_mut()
            .insert(dhcproto::v4::DhcpOption::ClientSystemArchitecture(
                dhcproto::v4::Architecture::from(7),
            ));
        m.encode(&mut Encoder::new(&mut req)).unwrap();
    }
    s.send_to(&req, ("127.0.0.1", proxy)).unwrap();
    let mut rb = [0u8; 1500];
    assert!(
        s.recv(&mut rb).is_err(),
        "someone answered for a frozen child"
    );
    assert!(!fetch("snponly.efi").status.success());
    let (status, _) = {
        let o = std::process::Command::new("curl")
            .args([
                "-s",
                "--max-time",
                "2",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
            ])
            .arg(format!("http://{}/api/compute/boot/chain.ipxe", a.http))
            .output()
            .unwrap();
        (String::from_utf8_lossy(&o.stdout).to_string(), ())
    };
    assert_eq!(
        status, "000",
        "the HTTP listener answered for a frozen child"
    );

    // Killed, it is restarted, and the request that waited in the socket is answered.
    signal("-KILL", child);
    s.set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    let n = s
        .recv(&mut rb)
        .expect("the queued request is answered by the new child");
    use dhcproto::Decodable;
    let ack = dhcproto::v4::Message::decode(&mut dhcproto::Decoder::new(&rb[..n])).unwrap();
    assert_eq!(ack.xid(), 0x5eed);
    assert_ne!(net_child(&a), child);
    assert_eq!(fetch("snponly.efi").stdout, b"efi");
    // The new child's counters reach /metrics through the parent; the boot lease is recorded.
    let (_, metrics) = curl(&a, "/metrics", "GET");
    assert!(metrics.contains("bca_dhcp_answers_total 1"), "{metrics}");
    assert!(
        metrics.contains("bca_tftp_transfers_total{result=\"complete\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("bca_privsep_child_restarts_total 1"),
        "{metrics}"
    );
    let leases = a.cli_json(&["boot", "leases", "--mac", "52:54:00:12:34:56"]);
    assert_eq!(leases["items"][0]["file"], "snponly.efi", "{leases}");
}

#[test]
fn under_the_units_ambient_capability_the_child_holds_none() {
    // The packaged unit's situation: serve runs as an unprivileged user with the ambient
    // CAP_NET_BIND_SERVICE, which execve would pass on to the child.
    let (dir, out) = init_dir("file", &[]);
    assert!(out.status.success());
    let state = dir.path().join("state");
    assert!(std::process::Command::new("chown")
        .args(["-R", "65534:65534"])
        .arg(dir.path())
        .status()
        .unwrap()
        .success());
    let mut serve = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=+net_bind_service",
            "--ambient-caps=+net_bind_service",
            bin(),
            "serve",
            "--listen-http",
            "127.0.0.1:0",
            "--listen-gateway",
            "127.0.0.1:0",
        ])
        .env("BCA_STATE_DIR", &state)
        .env("BCA_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(serve.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert!(
        line.contains("\"ready\":true"),
        "serve did not start: {line:?}"
    );
    let parent = serve.id();
    // Stopped however the test ends: a serve left running would hold the test's output open.
    struct Stop(std::process::Child);
    impl Drop for Stop {
        fn drop(&mut self) {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &self.0.id().to_string()])
                .status();
            let _ = self.0.wait();
        }
    }
    let _serve = Stop(serve);
    let child = net_child_of(parent);
    let bind_service = format!("{:016x}", 1u64 << 10);
    assert_eq!(status_field(parent, "CapAmb"), bind_service);
    for field in ["CapAmb", "CapEff", "CapPrm", "CapInh"] {
        assert_eq!(status_field(child, field), "0000000000000000", "{field}");
    }
    assert_eq!(status_field(child, "Seccomp"), "2");
}
