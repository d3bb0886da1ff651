//! Faults a rack really has: here, a full disk. The state directory lives on a small
//! loop-mounted ext4 that fills up while machines join.

use crate::common::*;
use bca::proto::protocol::{Empty, Hello, Reply, Request};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A small ext4 file system, loop-mounted; unmounted when dropped.
struct SmallFs {
    _dir: tempfile::TempDir,
    mnt: PathBuf,
}

impl SmallFs {
    fn new(mib: u32) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("fs.img");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        sh(&format!(
            "dd if=/dev/zero of={} bs=1M count={mib} status=none && mkfs.ext4 -q -F {} && mount -o loop {} {}",
            img.display(),
            img.display(),
            img.display(),
            mnt.display()
        ));
        SmallFs { _dir: dir, mnt }
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
    }
}

fn sh(cmd: &str) -> std::process::Output {
    let o = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    assert!(
        o.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// Writes zeros to `path` until the file system is full.
fn fill(path: &Path) {
    let _ = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "dd if=/dev/zero of={} bs=64k status=none",
            path.display()
        ))
        .output()
        .unwrap();
}

fn healthz(a: &Appliance) -> (u16, serde_json::Value) {
    let (code, body) = curl(a, "/healthz", "GET");
    (code, serde_json::from_str(&body).unwrap_or_default())
}

#[test]
fn a_full_disk_answers_unavailable_loses_nothing_and_recovers_by_itself() {
    let fs = SmallFs::new(24);
    let mut a = Appliance::start();
    // The state directory moves onto the small file system.
    a.stop();
    let state = a.state();
    sh(&format!("cp -a {} {}/", state.display(), fs.mnt.display()));
    std::fs::remove_dir_all(&state).unwrap();
    std::os::unix::fs::symlink(fs.mnt.join("state"), &state).unwrap();
    a.serve(PASSPHRASE);
    let sim = Sim::new(&a);
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, json!({"maxUses": 5000}));
    assert_eq!(healthz(&a).0, 200);

    // A node with a live session before the disk fills.
    let (raw, csr, key) = sim.join(&token, &machine());
    let reply: Reply = serde_json::from_slice(&raw).unwrap();
    let body =
        bca::agent::verify_response(&sim.cfg, &reply.join_response.unwrap(), &csr, &key, "node")
            .unwrap();
    let mut issued = vec![{
        let leaf =
            bca::proto::x509::pem_decode_all(&body.certificate_chain[0], "CERTIFICATE").remove(0);
        bca::proto::x509::parse_node_leaf(&leaf).unwrap().serial_hex
    }];
    let chain: Vec<Vec<u8>> = body
        .certificate_chain
        .iter()
        .map(|p| bca::proto::x509::pem_decode_all(p, "CERTIFICATE").remove(0))
        .collect();
    let rt = rt();
    let mut session = rt.block_on(async {
        let mut s = bca::agent::connect(&sim.cfg, Some((chain.clone(), key.pkcs8())))
            .await
            .unwrap();
        let hello = Request {
            v: 1,
            hello: Some(Hello::default()),
            ..Default::default()
        };
        let raw = bca::agent::roundtrip(&sim.cfg, &mut s, &serde_json::to_vec(&hello).unwrap())
            .await
            .unwrap();
        assert!(serde_json::from_slice::<Reply>(&raw)
            .unwrap()
            .welcome
            .is_some());
        s
    });

    // The disk fills up during a join storm: every answer is a certificate whose row is written,
    // or UNAVAILABLE.
    let filler = fs.mnt.join("filler");
    fill(&filler);
    let mut unavailable = 0;
    for _ in 0..40 {
        let (raw, csr, k) = sim.join(&token, &machine());
        let reply: Reply = serde_json::from_slice(&raw).unwrap();
        match (reply.join_response, reply.error) {
            (Some(r), _) => {
                let b = bca::agent::verify_response(&sim.cfg, &r, &csr, &k, "node").unwrap();
                let leaf = bca::proto::x509::pem_decode_all(&b.certificate_chain[0], "CERTIFICATE")
                    .remove(0);
                issued.push(bca::proto::x509::parse_node_leaf(&leaf).unwrap().serial_hex);
            }
            (None, Some(e)) => {
                assert_eq!(e.code, "UNAVAILABLE", "{}", e.message);
                unavailable += 1;
            }
            _ => panic!("{}", String::from_utf8_lossy(&raw)),
        }
    }
    assert!(unavailable > 0, "the disk never filled");

    // The admin API says why; /healthz fails its disk check; doctor says so. (A write that fits
    // in the space SQLite's log already holds may still be taken: whatever is acknowledged is
    // kept, checked below.)
    let mut made = Vec::new();
    let e = loop {
        let name = format!("full-{}", made.len());
        match a.api(
            "pools/create",
            json!({"tenantId": a.root_tenant(), "name": name}),
        ) {
            Ok(_) => {
                made.push(name);
                assert!(made.len() < 500, "the full disk never refused a write");
            }
            Err(e) => break e,
        }
    };
    assert_eq!(e.code, bca::base::error::Code::Unavailable, "{e}");
    assert!(e.message.contains("disk is full"), "{e}");
    let (code, h) = healthz(&a);
    assert_eq!(code, 503, "{h}");
    assert_eq!(h["disk"]["ok"], false, "{h}");
    assert!(
        h["disk"]["problem"]
            .as_str()
            .unwrap()
            .contains("disk is full"),
        "{h}"
    );
    let o = a.cli(&["doctor"]);
    assert_eq!(o.status.code(), Some(1));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("FAIL disk: the state directory's disk is full"),
        "{out}"
    );
    // The session is still served (its heartbeat answered), and so is the well-known document.
    rt.block_on(async {
        let hb = Request {
            v: 1,
            heartbeat: Some(Empty {}),
            ..Default::default()
        };
        let raw = bca::agent::roundtrip(&sim.cfg, &mut session, &serde_json::to_vec(&hb).unwrap())
            .await
            .unwrap();
        assert!(serde_json::from_slice::<Reply>(&raw).unwrap().ack.is_some());
    });
    assert_eq!(
        curl(&a, "/api/compute/.well-known/better-compute", "GET").0,
        200
    );

    // Space freed: the appliance recovers by itself.
    std::fs::remove_file(&filler).unwrap();
    assert_eq!(healthz(&a).0, 200);
    let again = sim.admitted(&token, &machine());
    issued.push({
        let leaf =
            bca::proto::x509::pem_decode_all(&again.certificate_chain[0], "CERTIFICATE").remove(0);
        bca::proto::x509::parse_node_leaf(&leaf).unwrap().serial_hex
    });
    a.api_ok(
        "pools/create",
        json!({"tenantId": a.root_tenant(), "name": "more"}),
    );
    assert_eq!(healthz(&a).1["disk"]["ok"], true);

    // Nothing acknowledged was lost, uses spent equal nodes admitted, and the database is whole.
    for s in &issued {
        assert_eq!(
            a.count(&format!(
                "SELECT count(*) FROM node_certs WHERE serial = '{s}'"
            )),
            1,
            "an acknowledged certificate has no row"
        );
    }
    for name in &made {
        assert_eq!(
            a.count(&format!("SELECT count(*) FROM pools WHERE name = '{name}'")),
            1,
            "an acknowledged pool was lost"
        );
    }
    let nodes = a.count("SELECT count(*) FROM nodes");
    assert_eq!(nodes as usize, issued.len());
    assert_eq!(a.count("SELECT 5000 - uses_left FROM join_tokens"), nodes);
    let ok: String = a
        .db()
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(ok, "ok");
    a.stop();
    drop(a);
    drop(fs);
}

/// How many power cuts `make test` makes (`BCA_POWER_CUTS`, more under `make soak`).
/// Discovered machines waiting for an approval in the power-cut storm.
const WAITING: usize = 12;

fn power_cuts() -> usize {
    std::env::var("BCA_POWER_CUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
}

fn image() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("image/out")
}

fn free_tcp() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A node the storm holds: its chain (DER), key and id.
pub(crate) struct Held {
    pub(crate) id: String,
    chain: Vec<Vec<u8>>,
    key: bca::base::crypto::SigningKey,
}

pub(crate) fn serial_of(chain_pem: &[String]) -> String {
    let der = bca::proto::x509::pem_decode_all(&chain_pem[0], "CERTIFICATE").remove(0);
    bca::proto::x509::parse_node_leaf(&der).unwrap().serial_hex
}

pub(crate) fn held(id: String, chain_pem: &[String], key: bca::base::crypto::SigningKey) -> Held {
    Held {
        id,
        chain: chain_pem
            .iter()
            .map(|p| bca::proto::x509::pem_decode_all(p, "CERTIFICATE").remove(0))
            .collect(),
        key,
    }
}

/// One renewal of `n` over mTLS: the new certificate's serial and the node with its new key, or
/// nothing (refused, or the appliance gone).
pub(crate) fn renew(
    cfg: &bca::proto::agent_config::AgentConfig,
    n: &Held,
) -> Option<(String, Held)> {
    use bca::base::crypto;
    let key = crypto::SigningKey::generate();
    let csr = bca::proto::csr::create(&key);
    let now = bca::base::clock::now();
    let msg = bca::proto::protocol::renew_pop_message(&crypto::sha256(&csr), &n.id, now);
    let req = Request {
        v: 1,
        renew: Some(bca::proto::protocol::RenewRequest {
            csr: crypto::b64(&csr),
            chain: n
                .chain
                .iter()
                .map(|d| bca::proto::x509::pem("CERTIFICATE", d))
                .collect(),
            client_time: now,
            pop_sig: crypto::b64(&n.key.sign(bca::proto::protocol::RENEW_POP_PURPOSE, &msg)),
            key_attestation: None,
        }),
        ..Default::default()
    };
    let raw = rt().block_on(async {
        let mut s = bca::agent::connect(cfg, Some((n.chain.clone(), n.key.pkcs8())))
            .await
            .ok()?;
        bca::agent::roundtrip(cfg, &mut s, &serde_json::to_vec(&req).unwrap())
            .await
            .ok()
    })?;
    let r = serde_json::from_slice::<Reply>(&raw).ok()?.renew_response?;
    let body = bca::agent::verify_response(cfg, &r, &csr, &key, "node").ok()?;
    Some((
        serial_of(&body.certificate_chain),
        held(body.node_id, &body.certificate_chain, key),
    ))
}

/// A site whose appliance runs in a QEMU VM (the ramdisk image's `bca.serve` mode) on a state
/// disk of its own: made on the host (init, a pool and a token, the agents' files), booted and
/// checked by the fault tests.
struct VmSite {
    /// The site as made on the host (stopped); its folder holds the disk image.
    a: Appliance,
    img: PathBuf,
    mnt: PathBuf,
    state: PathBuf,
    gw: u16,
    http: u16,
    token: String,
    /// A token that expires half an hour after the site is made.
    short: String,
    sim: Sim,
    /// Machines that booted discovery on the host; [`VmSite::ask`] makes their requests.
    waiting: Vec<crate::crash::Waiting>,
    intake: String,
}

impl Drop for VmSite {
    fn drop(&mut self) {
        // A failed test may leave the disk mounted: never leave a loop device behind.
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.mnt)
            .stderr(std::process::Stdio::null())
            .status();
    }
}

impl VmSite {
    fn new() -> Self {
        Self::with_waiting(0)
    }

    /// [`VmSite::new`], with `waiting` machines whose join requests wait for an approval.
    fn with_waiting(waiting: usize) -> Self {
        // The site, made on the host (a pool, a token, the agents' files), then its state
        // directory moved onto the VM's disk. The VM has no user for the network child to run
        // as: privilege separation off.
        let mut a = Appliance::start_cfg("file", &[], |t| {
            replace_table(
                &t,
                "privsep",
                "[privsep]\nenabled = false\nuser = \"nobody\"\n\n",
            )
        });
        let pool = a.pool("rack");
        let (_, token) = a.token(&pool, json!({"maxUses": 10000}));
        let (_, short) = a.token(&pool, json!({"maxUses": 10, "ttlSeconds": 1800}));
        let intake = a.pool("intake");
        let mut machines = Vec::new();
        if waiting > 0 {
            // The machines boot discovery against the appliance while it runs on the host (its
            // boot server on loopback), then the site goes to the VM with its config as it was.
            // They ask to join through the VM ([`VmSite::ask`]): a request answers only the
            // address its first join came from, and the VM sees the host as 10.0.2.2.
            let cfg = a.state().join("config.toml");
            let saved = std::fs::read_to_string(&cfg).unwrap();
            std::fs::write(
                &cfg,
                format!("gateway_url = \"https://{}\"\n{saved}", a.gateway),
            )
            .unwrap();
            enable_sightings(&mut a);
            machines = (0..waiting)
                .map(|i| crate::crash::booted_machine(&a, &format!("52:54:00:dd:00:{i:02x}")))
                .collect();
            a.stop();
            std::fs::write(&cfg, saved).unwrap();
        } else {
            a.stop();
        }
        let (gw, http) = (free_tcp(), free_tcp());
        let agent = a.dir.path().join("agent");
        let o = a.cli(&[
            "daemon",
            "agent-config",
            "--gateway-url",
            &format!("https://127.0.0.1:{gw}"),
            "--out",
            agent.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let img = a.dir.path().join("state.img");
        let mnt = a.dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        sh(&format!(
            "dd if=/dev/zero of={img} bs=1M count=64 status=none && mkfs.ext4 -q -F {img} \
             && mount -o loop {img} {mnt} && cp -a {state} {mnt}/ && umount {mnt}",
            img = img.display(),
            mnt = mnt.display(),
            state = a.state().display()
        ));
        let state = mnt.join("state");
        let cfg = bca::proto::agent_config::AgentConfig::load(&agent.join("config.toml")).unwrap();
        let enc = cfg
            .join_encryption_point(&agent.join("config.toml"))
            .unwrap();
        let sim = Sim { cfg, enc };

        VmSite {
            a,
            img,
            mnt,
            state,
            gw,
            http,
            token,
            short,
            sim,
            waiting: machines,
            intake,
        }
    }

    /// The waiting machines ask to join through the VM (one boot, then the power cut), and
    /// their requests' ids are read off the disk.
    fn ask(&mut self) {
        let console = self.a.dir.path().join("console-ask.log");
        let mut vm = self.boot(&console, &[]);
        for m in &self.waiting {
            crate::crash::ask(&self.sim, m);
        }
        vm.kill().unwrap();
        vm.wait().unwrap();
        self.mount();
        {
            let db = rusqlite::Connection::open(self.state.join("bca.db")).unwrap();
            for m in &mut self.waiting {
                m.request = db
                    .query_row(
                        "SELECT id FROM join_requests WHERE mac = ?1",
                        [&m.mac],
                        |r| r.get(0),
                    )
                    .unwrap();
            }
        }
        self.umount();
    }

    fn mount(&self) {
        sh(&format!(
            "mount -o loop {} {}",
            self.img.display(),
            self.mnt.display()
        ));
    }

    fn umount(&self) {
        sh(&format!("umount {}", self.mnt.display()));
    }

    /// Boots the VM on the state disk (`cache=none`), its console to `console`, with `extra`
    /// QEMU arguments, and waits until `bca serve` answers on its gateway.
    fn boot(&self, console: &Path, extra: &[String]) -> std::process::Child {
        let drive = format!(
            "file={},format=raw,if=virtio,cache=none",
            self.img.display()
        );
        self.boot_on(console, extra, &drive)
    }

    /// [`VmSite::boot`] on a disk that loses what the guest did not flush when the power goes
    /// (`crate::lossy`; cut number `cut` chooses whether some unflushed sectors survive): kill
    /// QEMU, then `LossyDisk::cut`.
    fn boot_lossy(
        &self,
        console: &Path,
        extra: &[String],
        cut: usize,
    ) -> (std::process::Child, crate::lossy::LossyDisk) {
        let disk = crate::lossy::LossyDisk::serve(&self.img, self.a.dir.path(), cut);
        let vm = self.boot_on(console, extra, &disk.drive());
        (vm, disk)
    }

    fn boot_on(&self, console: &Path, extra: &[String], drive: &str) -> std::process::Child {
        let mut vm = Command::new("qemu-system-x86_64")
            .args([
                "-accel",
                "tcg",
                "-m",
                "512",
                "-display",
                "none",
                "-no-reboot",
            ])
            .arg("-serial")
            .arg(format!("file:{}", console.display()))
            .arg("-kernel")
            .arg(image().join("vmlinuz"))
            .arg("-initrd")
            .arg(image().join("initrd.img"))
            .args(["-append", "console=ttyS0 bca.serve"])
            .arg("-drive")
            .arg(drive)
            .args([
                "-netdev",
                &format!(
                    "user,id=n0,hostfwd=tcp:127.0.0.1:{}-:8443,hostfwd=tcp:127.0.0.1:{}-:8080",
                    self.gw, self.http
                ),
                "-device",
                "virtio-net-pci,netdev=n0",
            ])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let ping = serde_json::to_vec(&Request {
            v: 1,
            ping: Some(Empty {}),
            ..Default::default()
        })
        .unwrap();
        let t = std::time::Instant::now();
        while bca::agent::exchange_raw(&self.sim.cfg, &ping).is_err() {
            if t.elapsed() > std::time::Duration::from_secs(180) {
                let _ = vm.kill();
                panic!(
                    "the appliance did not come up; console:\n{}",
                    std::fs::read_to_string(console).unwrap_or_default()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
        vm
    }
}

/// Real power cuts: `bca serve` (the static binary, in the ramdisk image's `bca.serve` mode) runs
/// in a QEMU VM whose state directory is on a virtio disk with a volatile write cache
/// (`crate::lossy`: what the guest did not flush is lost with the power, or a random part of it
/// kept, in no order, as a real drive's cache may have written some), while the host drives joins and renewals through the VM's
/// gateway and an operator approves waiting machines through the VM's CLI (its control port),
/// each approved machine then joining with its approved CSR; every acknowledged certificate and
/// approval is recorded. QEMU is killed (-9) at a random moment
/// under load, the disk is checked (journal replayed by the host's mount, as a reboot would), and
/// the VM boots again on it.
#[test]
fn power_cuts_under_joins_renewals_and_approvals_lose_nothing_acknowledged() {
    let _vm = vm_lock();
    let mut site = VmSite::with_waiting(WAITING);
    site.ask();
    let site = site;
    let acked = std::sync::Mutex::new(Vec::<String>::new());
    let nodes = std::sync::Mutex::new(Vec::<Held>::new());
    // Indexes into `site.waiting`: approvals acknowledged (`join-requests approve` exited 0 in
    // the VM), and machines admitted with their approved CSR.
    let approved = std::sync::Mutex::new(Vec::<usize>::new());
    let admitted = std::sync::Mutex::new(Vec::<usize>::new());
    let (mut joins, mut renewals) = (0usize, 0usize);
    // Unflushed sectors the cuts lost and kept, and the flushes the guest made.
    let (mut lost, mut kept, mut flushes, mut sharp) = (0usize, 0usize, 0usize, 0usize);
    for cut in 0..power_cuts() {
        let console = site.a.dir.path().join(format!("console-{cut}.log"));
        let ctl = site.a.dir.path().join(format!("ctl-storm-{cut}.sock"));
        // `bca serve` starts by itself on what the cut left: its gateway answers.
        let (mut vm, disk) = site.boot_lossy(
            &console,
            &[
                "-serial".into(),
                format!("unix:{},server,nowait", ctl.display()),
            ],
            cut,
        );
        // A storm of joins and renewals; the power goes at a random moment within it.
        let mut r = [0u8; 2];
        bca::base::crypto::fill_random(&mut r);
        let after = std::time::Duration::from_millis(1500 + u16::from_le_bytes(r) as u64 % 4000);
        let stop = std::sync::atomic::AtomicBool::new(false);
        let counts = std::thread::scope(|s| {
            let workers: Vec<_> = (0..3)
                .map(|w| {
                    let (sim, acked, nodes, stop, token) =
                        (&site.sim, &acked, &nodes, &stop, &site.token);
                    s.spawn(move || {
                        let (mut j, mut rn) = (0, 0);
                        let mut i = 0u32;
                        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                            i += 1;
                            let renewing = (i + w) % 3 == 0;
                            let old = if renewing {
                                nodes.lock().unwrap().pop()
                            } else {
                                None
                            };
                            if let Some(n) = old {
                                match renew(&sim.cfg, &n) {
                                    Some((serial, new)) => {
                                        acked.lock().unwrap().push(serial);
                                        nodes.lock().unwrap().push(new);
                                        rn += 1;
                                    }
                                    None => nodes.lock().unwrap().push(n),
                                }
                                continue;
                            }
                            let Ok((raw, csr, key)) = sim.try_join(token, &machine()) else {
                                continue;
                            };
                            let Ok(reply) = serde_json::from_slice::<Reply>(&raw) else {
                                continue;
                            };
                            if let Some(resp) = reply.join_response {
                                let body = bca::agent::verify_response(
                                    &sim.cfg, &resp, &csr, &key, "node",
                                )
                                .expect("an acknowledged join verifies");
                                acked
                                    .lock()
                                    .unwrap()
                                    .push(serial_of(&body.certificate_chain));
                                nodes.lock().unwrap().push(held(
                                    body.node_id,
                                    &body.certificate_chain,
                                    key,
                                ));
                                j += 1;
                            }
                        }
                        (j, rn)
                    })
                })
                .collect();
            // The operator approves the waiting machines one by one through the VM's CLI...
            let approver = {
                let (site, approved, stop, ctl, console) =
                    (&site, &approved, &stop, &ctl, &console);
                s.spawn(move || {
                    use std::io::Write;
                    // Refused this boot: approved before a cut took the answer (then the
                    // approval was never acknowledged, and is not counted).
                    let mut refused = Vec::new();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let next = {
                            let ap = approved.lock().unwrap();
                            (0..site.waiting.len())
                                .find(|i| !ap.contains(i) && !refused.contains(i))
                        };
                        let Some(i) = next else { break };
                        let id = &site.waiting[i].request;
                        let Ok(mut c) = std::os::unix::net::UnixStream::connect(ctl) else {
                            break;
                        };
                        let line = format!("approve:{id}:{}\n", site.intake);
                        // (The connection stays open until the answer: QEMU drops what a
                        // client that hung up at once had written.)
                        if c.write_all(line.as_bytes()).is_err() {
                            break;
                        }
                        let done = format!("bca: approve {id} ended with status ");
                        let status = loop {
                            if stop.load(std::sync::atomic::Ordering::Relaxed) {
                                break None;
                            }
                            let text = std::fs::read_to_string(console).unwrap_or_default();
                            if let Some(rest) = text.split(&done).nth(1) {
                                break rest.split_whitespace().next().map(str::to_string);
                            }
                            std::thread::sleep(std::time::Duration::from_millis(100));
                        };
                        // The operator's pace: a pause, so that approvals spread over the
                        // boots and some are cut in flight.
                        let mut r = [0u8; 1];
                        bca::base::crypto::fill_random(&mut r);
                        std::thread::sleep(std::time::Duration::from_millis(300 + 6 * r[0] as u64));
                        match status.as_deref() {
                            Some("0") => approved.lock().unwrap().push(i),
                            Some(_) => refused.push(i),
                            None => break,
                        }
                    }
                })
            };
            // ...and each approved machine, retrying with its approved CSR, is admitted.
            let consumer = {
                let (site, approved, admitted, acked, stop) =
                    (&site, &approved, &admitted, &acked, &stop);
                s.spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let next = {
                            let (ap, ad) = (approved.lock().unwrap(), admitted.lock().unwrap());
                            ap.iter().copied().find(|i| !ad.contains(i))
                        };
                        let Some(i) = next else {
                            std::thread::sleep(std::time::Duration::from_millis(200));
                            continue;
                        };
                        if let Some((serial, _)) =
                            crate::crash::admitted_join(&site.sim, &site.waiting[i])
                        {
                            acked.lock().unwrap().push(serial);
                            admitted.lock().unwrap().push(i);
                        }
                    }
                })
            };
            std::thread::sleep(after);
            // The power cut, the moment the guest next waits on a flush with writes pending.
            if disk.arm(std::time::Duration::from_secs(10)) {
                sharp += 1;
            }
            vm.kill().unwrap();
            vm.wait().unwrap();
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            approver.join().unwrap();
            consumer.join().unwrap();
            workers
                .into_iter()
                .map(|w| w.join().unwrap())
                .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
        });
        joins += counts.0;
        renewals += counts.1;
        let c = disk.cut();
        lost += c.unflushed - c.kept;
        kept += c.kept;
        flushes += c.flushes;

        // What the disk holds after the cut (the host's mount replays the journal; SQLite its WAL).
        site.mount();
        {
            let db = rusqlite::Connection::open(site.state.join("bca.db")).unwrap();
            let ok: String = db
                .query_row("PRAGMA integrity_check", [], |r| r.get(0))
                .unwrap();
            assert_eq!(ok, "ok", "cut {cut}");
            for s in acked.lock().unwrap().iter() {
                let n: i64 = db
                    .query_row(
                        "SELECT count(*) FROM node_certs c JOIN nodes n ON n.id = c.node_id WHERE c.serial = ?1",
                        [s],
                        |r| r.get(0),
                    )
                    .unwrap();
                assert_eq!(n, 1, "cut {cut}: the acknowledged certificate {s} is lost");
            }
            for &i in approved.lock().unwrap().iter() {
                let m = &site.waiting[i];
                let state: String = db
                    .query_row(
                        "SELECT state FROM join_requests WHERE id = ?1",
                        [&m.request],
                        |r| r.get(0),
                    )
                    .unwrap();
                let want: &[&str] = if admitted.lock().unwrap().contains(&i) {
                    &["consumed"]
                } else {
                    &["approved", "consumed"]
                };
                assert!(
                    want.contains(&state.as_str()),
                    "cut {cut}: the acknowledged approval of {} is {state}",
                    m.request
                );
            }
            let (nodes_n, spent): (i64, i64) = db
                .query_row(
                    "SELECT (SELECT count(*) FROM nodes WHERE attestor = 'join-token'), (SELECT max_uses - uses_left FROM join_tokens)",
                    [],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .unwrap();
            assert_eq!(
                nodes_n, spent,
                "cut {cut}: uses spent differ from nodes admitted"
            );
            assert!(spent <= 10_000);
        }
        site.umount();
    }
    let (approvals, consumed) = (
        approved.lock().unwrap().len(),
        admitted.lock().unwrap().len(),
    );
    eprintln!(
        "power cuts: {} survived; acknowledged across them: {joins} joins, {renewals} renewals, \
         {approvals} approvals, {consumed} approved machines admitted; nothing lost \
         (the disk's cache lost {lost} unflushed sectors and kept {kept}; {flushes} flushes; \
         {sharp} cuts with a flush in flight)",
        power_cuts()
    );
    assert!(
        lost > 0 && sharp > 0,
        "no cut found anything unflushed to lose: the cut is not a cut"
    );
    assert!(joins > 0, "no join was acknowledged");
    assert!(approvals > 0, "no approval was acknowledged");
    assert!(consumed > 0, "no approved machine was admitted");
}

/// A dying disk: the VM's state disk starts failing every I/O (its backend removed under it,
/// QEMU's `drive_del`). Joins answer `UNAVAILABLE` and nothing more is acknowledged, `/healthz`
/// is 503, and the log says the disk fails writes.
#[test]
fn a_dying_disk_answers_unavailable_stops_acknowledging_and_says_so() {
    let _vm = vm_lock();
    let site = VmSite::new();
    let console = site.a.dir.path().join("console-dying.log");
    let monitor = site.a.dir.path().join("monitor.sock");
    let mut vm = site.boot(
        &console,
        &[
            "-monitor".into(),
            format!("unix:{},server,nowait", monitor.display()),
        ],
    );
    let healthz = || {
        let o = Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
            .arg(format!("http://127.0.0.1:{}/healthz", site.http))
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    assert_eq!(healthz(), "200");
    let join = || {
        let (raw, _, _) = site.sim.join(&site.token, &machine());
        serde_json::from_slice::<Reply>(&raw).unwrap()
    };
    assert!(join().join_response.is_some());

    // The disk dies.
    {
        use std::io::{Read, Write};
        let mut m = std::os::unix::net::UnixStream::connect(&monitor).unwrap();
        m.write_all(b"drive_del virtio0\n").unwrap();
        let mut buf = [0u8; 256];
        std::thread::sleep(std::time::Duration::from_millis(500));
        m.set_nonblocking(true).unwrap();
        let _ = m.read(&mut buf);
    }
    let mut failed = false;
    for _ in 0..10 {
        let r = join();
        match (r.join_response, r.error) {
            (Some(_), _) => assert!(
                !failed,
                "a join was acknowledged after the disk failed a write"
            ),
            (None, Some(e)) => {
                assert_eq!(e.code, "UNAVAILABLE", "{}", e.message);
                failed = true;
            }
            _ => panic!("neither an answer nor an error"),
        }
    }
    assert!(failed, "the dead disk never failed a write");
    assert_eq!(healthz(), "503");
    let log = std::fs::read_to_string(&console).unwrap();
    assert!(
        log.contains("the state directory's disk fails writes"),
        "{log}"
    );
    let _ = vm.kill();
    let _ = vm.wait();
}

/// Steps the VM's wall clock through its control port (image/init, `bca.serve` mode) and waits
/// for the console to say it did.
fn step_clock(ctl: &Path, console: &Path, step: &str) {
    use std::io::Write;
    let before = std::fs::read_to_string(console)
        .unwrap_or_default()
        .matches("bca: clock stepped")
        .count();
    let mut s = std::os::unix::net::UnixStream::connect(ctl).unwrap();
    s.write_all(format!("clock:{step}\n").as_bytes()).unwrap();
    let t = std::time::Instant::now();
    while std::fs::read_to_string(console)
        .unwrap_or_default()
        .matches("bca: clock stepped")
        .count()
        == before
    {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(20),
            "the clock was not stepped"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A clock that jumps, inside the VM: an hour forward, and an hour back. The appliance issues no
/// certificate from the future (every machine's signed time disagrees with it: joins and
/// renewals are refused), raises its clock warnings (`/healthz` degraded), refuses a replayed
/// renewal after the step back, and serves again once the clock is right.
#[test]
fn a_clock_that_jumps_issues_nothing_from_the_future_and_is_reported() {
    let _vm = vm_lock();
    let site = VmSite::new();
    let console = site.a.dir.path().join("console-clock.log");
    let ctl = site.a.dir.path().join("ctl.sock");
    let mut vm = site.boot(
        &console,
        &[
            "-serial".into(),
            format!("unix:{},server,nowait", ctl.display()),
        ],
    );
    let status = || {
        let o = Command::new("curl")
            .arg("-s")
            .arg(format!("http://127.0.0.1:{}/healthz", site.http))
            .output()
            .unwrap();
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap_or_default()["status"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    // Five nodes (the skew warning wants five nodes' signed clocks).
    let mut nodes = Vec::new();
    for _ in 0..5 {
        let (raw, csr, key) = site.sim.join(&site.token, &machine());
        let r: Reply = serde_json::from_slice(&raw).unwrap();
        let body = bca::agent::verify_response(
            &site.sim.cfg,
            &r.join_response.unwrap(),
            &csr,
            &key,
            "node",
        )
        .unwrap();
        nodes.push(held(body.node_id, &body.certificate_chain, key));
    }
    assert_eq!(status(), "ok");

    // An hour forward: joins (their seal's time) and renewals (their signed time) disagree with
    // the appliance by an hour: refused, nothing issued; the agents' clocks are reported.
    step_clock(&ctl, &console, "+3600");
    let (raw, _, _) = site.sim.join(&site.token, &machine());
    assert_eq!(raw, refused_bytes(), "{}", String::from_utf8_lossy(&raw));
    for n in &nodes {
        assert!(
            renew(&site.sim.cfg, n).is_none(),
            "a renewal an hour off was issued"
        );
    }
    assert_eq!(status(), "degraded");

    // Back to the right time: it serves again. The half-hour token, expired in the jumped
    // clock's eyes, is alive again: nothing the jump judged was kept.
    step_clock(&ctl, &console, "-3600");
    let renewed = renew(&site.sim.cfg, &nodes[0]).expect("a renewal at the right time");
    for token in [&site.token, &site.short] {
        let (raw, _, _) = site.sim.join(token, &machine());
        assert!(
            serde_json::from_slice::<Reply>(&raw)
                .unwrap()
                .join_response
                .is_some(),
            "{}",
            String::from_utf8_lossy(&raw)
        );
    }

    // An hour back: the newest records are in its future ("went backwards"); machines' times
    // are refused again.
    step_clock(&ctl, &console, "-3600");
    let (raw, _, _) = site.sim.join(&site.token, &machine());
    assert_eq!(raw, refused_bytes());
    assert!(renew(&site.sim.cfg, &renewed.1).is_none());
    assert_eq!(status(), "degraded");
    step_clock(&ctl, &console, "+3600");
    let _ = vm.kill();
    let _ = vm.wait();

    // No certificate on the disk starts in the real time's future beyond the back-dating.
    site.mount();
    {
        let db = rusqlite::Connection::open(site.state.join("bca.db")).unwrap();
        let latest: i64 = db
            .query_row("SELECT max(not_before) FROM node_certs", [], |r| r.get(0))
            .unwrap();
        assert!(
            latest <= bca::base::clock::now(),
            "a certificate starts in the future: {latest}"
        );
    }
    site.umount();
}

/// Power cuts while `bca backup` and `bca pki rotate` run inside the VM: the state starts again
/// each time, and a backup the cut interrupted is refused by `bca restore` (nothing left behind)
/// or restores whole, never half.
#[test]
fn power_cuts_during_backup_and_rotation_leave_a_state_that_starts() {
    use std::io::Write;
    let _vm = vm_lock();
    let site = VmSite::new();
    let mut outcomes = Vec::new();
    for (i, cmd) in ["backup:1", "rotate", "backup:2", "promote", "backup:3"]
        .into_iter()
        .enumerate()
    {
        let console = site.a.dir.path().join(format!("console-op-{i}.log"));
        let ctl = site.a.dir.path().join(format!("ctl-{i}.sock"));
        let (mut vm, disk) = site.boot_lossy(
            &console,
            &[
                "-serial".into(),
                format!("unix:{},server,nowait", ctl.display()),
            ],
            i,
        );
        let mut r = [0u8; 2];
        bca::base::crypto::fill_random(&mut r);
        std::os::unix::net::UnixStream::connect(&ctl)
            .unwrap()
            .write_all(format!("{cmd}\n").as_bytes())
            .unwrap();
        let span: u64 = std::env::var("BCA_CUT_SPAN_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1500);
        std::thread::sleep(std::time::Duration::from_millis(
            u16::from_le_bytes(r) as u64 % span,
        ));
        vm.kill().unwrap();
        vm.wait().unwrap();
        disk.cut();
        let said = std::fs::read_to_string(&console).unwrap_or_default();
        if let Some(l) = said.lines().find(|l| l.contains("ended with status")) {
            outcomes.push(format!("{cmd}: {l}"));
        }
        if let Some(n) = cmd.strip_prefix("backup:") {
            site.mount();
            let file = site.mnt.join(format!("backup-{n}.bca"));
            let copy = site.a.dir.path().join(format!("backup-{n}.bca"));
            let taken = std::fs::copy(&file, &copy).is_ok();
            site.umount();
            if taken {
                let restored = site.a.dir.path().join(format!("restored-{n}"));
                let o = Command::new(bin())
                    .args(["restore"])
                    .arg(&copy)
                    .arg("--state-dir")
                    .arg(&restored)
                    .env("BCA_SECRET", "power-cut")
                    .output()
                    .unwrap();
                if o.status.success() {
                    let db = rusqlite::Connection::open(restored.join("bca.db")).unwrap();
                    let ok: String = db
                        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
                        .unwrap();
                    assert_eq!(ok, "ok");
                    outcomes.push(format!("{cmd}: restored"));
                } else {
                    // Refused with a reason, and nothing left half-restored.
                    assert!(!o.stderr.is_empty());
                    assert!(
                        !restored.exists()
                            || std::fs::read_dir(&restored).unwrap().next().is_none(),
                        "a refused restore left files behind"
                    );
                    outcomes.push(format!(
                        "{cmd}: refused ({})",
                        String::from_utf8_lossy(&o.stderr).trim()
                    ));
                }
            } else {
                outcomes.push(format!("{cmd}: no file yet"));
            }
        } else {
            outcomes.push(format!("{cmd}: cut"));
        }
    }
    // After every cut the appliance starts by itself on what was left.
    let console = site.a.dir.path().join("console-after.log");
    let mut vm = site.boot(&console, &[]);
    vm.kill().unwrap();
    vm.wait().unwrap();
    eprintln!("cuts during operations: {outcomes:?}");
}

/// A backup the power cut short (any prefix of a whole one, as a cut during its write leaves
/// it) is refused by `bca restore`, which leaves nothing behind; the whole one restores.
#[test]
fn a_backup_cut_short_anywhere_is_refused_and_leaves_nothing() {
    let a = Appliance::start_with("passphrase", &[]);
    let pool = a.pool("p1");
    let (_, token) = a.token(&pool, json!({"maxUses": 2}));
    Sim::new(&a).admitted(&token, &machine());
    let file = a.dir.path().join("site.bcab");
    let o = a.cli(&["backup", file.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let whole = std::fs::read(&file).unwrap();
    let restore = |bytes: &[u8], n: usize| {
        let f = a.dir.path().join(format!("cut-{n}.bcab"));
        std::fs::write(&f, bytes).unwrap();
        let to = a.dir.path().join(format!("restored-{n}"));
        let o = Command::new(bin())
            .arg("restore")
            .arg(&f)
            .arg("--state-dir")
            .arg(&to)
            .env("BCA_SECRET", PASSPHRASE)
            .output()
            .unwrap();
        (o, to)
    };
    let mut r = [0u8; 64];
    bca::base::crypto::fill_random(&mut r);
    let mut cuts: Vec<usize> = r
        .chunks(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()) as usize % whole.len())
        .collect();
    cuts.extend([0, 1, 110, whole.len() / 2, whole.len() - 1]);
    let (o, full) = restore(&whole, 999);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The restored files, by path inside the state directory, with their hashes and modes.
    let tree = |d: &Path| -> Vec<(PathBuf, String, u32)> {
        sha256_file_tree(d)
            .into_iter()
            .map(|(p, h, m)| (p.strip_prefix(d).unwrap().to_path_buf(), h, m))
            .collect()
    };
    let whole_tree = tree(&full);
    let mut refused = 0;
    for (n, cut) in cuts.into_iter().enumerate() {
        let (o, to) = restore(&whole[..cut], n);
        if o.status.success() {
            // Only the archive's trailing padding was missing: every member is there and
            // verified, so what was restored is the whole backup, file for file.
            assert_eq!(
                tree(&to),
                whole_tree,
                "a backup cut at {cut} restored in part"
            );
            continue;
        }
        refused += 1;
        assert!(!o.stderr.is_empty());
        assert!(
            !to.exists() || std::fs::read_dir(&to).unwrap().next().is_none(),
            "a refused restore (cut at {cut}) left files behind"
        );
    }
    assert!(refused >= 15, "only {refused} cut backups were refused");
}
