//! A real network boot: a disk-less QEMU VM on a tap in a network namespace PXE-boots from
//! `bca serve` (the NIC's iPXE ROM, TFTP for the chain script, HTTP for the per-machine script,
//! the kernel, the initramfs and the per-boot archive), its ramdisk asks to join, an operator
//! approves it from the CLI, and it joins with a `ramdisk` certificate. SeaBIOS and OVMF (UEFI),
//! full DHCP, and proxyDHCP beside a separate DHCP server (dnsmasq), as at a real site.

use crate::common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn image() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("image/out")
}

fn sh(cmd: &str) {
    let o = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    assert!(
        o.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A network namespace with a bridge (the provisioning network) and a tap for the VM.
struct Netns {
    name: String,
    net: String,
}

impl Netns {
    fn new(tag: &str, octet: u8) -> Self {
        let name = format!("bca-{tag}-{}", rand_hex(3));
        let net = format!("10.{octet}.{}", 10 + (std::process::id() % 200));
        let n = &name;
        sh(&format!("ip netns add {n}"));
        sh(&format!("ip -n {n} link set lo up"));
        sh(&format!("ip -n {n} link add br0 type bridge"));
        sh(&format!("ip -n {n} addr add {net}.1/24 dev br0"));
        sh(&format!("ip -n {n} link set br0 up"));
        sh(&format!("ip -n {n} tuntap add tap0 mode tap"));
        sh(&format!("ip -n {n} link set tap0 master br0"));
        sh(&format!("ip -n {n} link set tap0 up"));
        Netns { name, net }
    }

    /// A namespace with only its loopback up, on the network `net` (`10.x.y`), wired by the
    /// caller.
    fn bare(tag: &str, net: String) -> Self {
        let name = format!("bca-{tag}-{}", rand_hex(3));
        sh(&format!("ip netns add {name}"));
        sh(&format!("ip -n {name} link set lo up"));
        Netns { name, net }
    }

    fn ip(&self) -> String {
        format!("{}.1", self.net)
    }

    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "pids", &self.name])
            .output()
            .map(|o| {
                for pid in String::from_utf8_lossy(&o.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-9", pid]).status();
                }
            });
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An appliance serving network boot inside the namespace.
fn appliance(ns: &Netns, mode: &str) -> Appliance {
    appliance_cfg(ns, mode, |t| t)
}

/// [`appliance`] with its `config.toml` passed through `edit` first.
fn appliance_cfg(ns: &Netns, mode: &str, edit: impl Fn(String) -> String) -> Appliance {
    appliance_cfg_http(ns, mode, 8080, edit)
}

/// [`appliance_cfg`] with its HTTP listener on port `http`.
fn appliance_cfg_http(
    ns: &Netns,
    mode: &str,
    http: u16,
    edit: impl Fn(String) -> String,
) -> Appliance {
    let (ip, net) = (ns.ip(), &ns.net);
    let boot = format!(
        "[boot]\nenabled = true\nmode = \"{mode}\"\ninterface = \"br0\"\nserver_ip = \"{ip}\"\nrange_start = \"{net}.100\"\n\
         range_end = \"{net}.150\"\nnetmask = \"255.255.255.0\"\nkernel_args = \"console=ttyS0\"\n"
    );
    appliance_init(ns, &ip, http, &boot, &[], edit)
}

/// An appliance serving network boot in `ns` at `ip`, with `boot` as its `[boot]` table and its
/// `config.toml` passed through `edit`.
fn appliance_in(ns: &Netns, ip: &str, boot: &str, edit: impl Fn(String) -> String) -> Appliance {
    appliance_init(ns, ip, 8080, boot, &[], edit)
}

/// [`appliance_in`], `bca init` given `init` too (`--store postgres://…`).
fn appliance_init(
    ns: &Netns,
    ip: &str,
    http: u16,
    boot: &str,
    init: &[&str],
    edit: impl Fn(String) -> String,
) -> Appliance {
    let url = format!("https://{ip}:8443");
    let (dir, out) = init_dir(
        "file",
        &[
            &["--gateway-san", ip, "--gateway-url", url.as_str()][..],
            init,
        ]
        .concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let state = dir.path().join("state");
    let cfg = state.join("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let text = replace_table(&text, "boot", boot)
        .replace("retry_after_seconds = 30", "retry_after_seconds = 2");
    std::fs::write(&cfg, edit(text)).unwrap();
    let root = state.join("boot");
    std::fs::create_dir_all(&root).unwrap();
    for f in [
        "vmlinuz",
        "initrd.img",
        "undionly.kpxe",
        "ipxe.efi",
        "snponly.efi",
        "shimx64.efi",
        "grubx64.efi",
    ] {
        std::fs::copy(image().join(f), root.join(f))
            .unwrap_or_else(|e| panic!("{f}: {e}: run make image"));
    }
    serve_in(ns, dir, ip, http)
}

/// `bca serve` of the state directory in `dir` inside `ns`, on `ip` (HTTP `http`, gateway 8443),
/// its log in `dir/serve.log`; once it said it is ready.
fn serve_in(ns: &Netns, dir: tempfile::TempDir, ip: &str, http: u16) -> Appliance {
    let mut child = ns
        .cmd(bin())
        .args([
            "serve",
            "--listen-http",
            &format!("{ip}:{http}"),
            "--listen-gateway",
            &format!("{ip}:8443"),
        ])
        .env("BCA_STATE_DIR", dir.path().join("state"))
        .env("BCA_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.path().join("serve.log")).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready: Value =
        serde_json::from_str(&line).unwrap_or_else(|_| panic!("serve did not start: {line:?}"));
    Appliance {
        dir,
        child: Some(child),
        http: ready["http"].as_str().unwrap().into(),
        gateway: ready["gateway"].as_str().unwrap().into(),
        socket: PathBuf::from(ready["admin"].as_str().unwrap()),
        init_stdout: String::new(),
    }
}

/// A VM on the namespace's tap, booting from the network, with `extra` QEMU arguments (a TPM, a
/// disk).
fn vm_with(
    ns: &Netns,
    a: &Appliance,
    mac: &str,
    uefi: bool,
    extra: &[String],
) -> (Killed, PathBuf) {
    let console = a
        .dir
        .path()
        .join(format!("console-{}.log", mac.replace(':', "")));
    let mut c = qemu(ns, mac, &console);
    c.args(["-boot", "n"]).args(extra);
    if uefi {
        let vars = a.dir.path().join("OVMF_VARS.fd");
        std::fs::copy("/usr/share/OVMF/OVMF_VARS_4M.fd", &vars).unwrap();
        c.args([
            "-drive",
            "if=pflash,format=raw,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.fd",
        ])
        .arg("-drive")
        .arg(format!("if=pflash,format=raw,file={}", vars.display()));
    }
    let child = c
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    (Killed(child), console)
}

/// QEMU under TCG on the namespace's tap, as the machine `mac` (its SMBIOS UUID and serial
/// follow from the MAC), its serial console to `console`.
fn qemu(ns: &Netns, mac: &str, console: &Path) -> Command {
    let mut c = ns.cmd("qemu-system-x86_64");
    c.args([
        "-accel",
        "tcg",
        "-m",
        "1024",
        "-display",
        "none",
        "-no-reboot",
        "-monitor",
        "none",
    ])
    .arg("-serial")
    .arg(format!("file:{}", console.display()))
    .args(["-netdev", "tap,id=n0,ifname=tap0,script=no,downscript=no"])
    .args(["-device", &format!("virtio-net-pci,netdev=n0,mac={mac}")])
    .args([
        "-smbios",
        &format!(
            "type=1,serial=VM-{},uuid=6a0c5d3e-1f2b-4c7d-9e8f-{}",
            mac.replace(':', ""),
            mac.replace(':', "")
        ),
    ]);
    c
}

fn wait_for<T>(what: &str, secs: u64, console: &Path, mut f: impl FnMut() -> Option<T>) -> T {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        if t.elapsed() > Duration::from_secs(secs) {
            let log = std::fs::read_to_string(console).unwrap_or_default();
            // The whole console, kept past the test's temporary directory.
            let keep = std::env::temp_dir().join(format!(
                "bca-{}",
                console.file_name().unwrap().to_string_lossy()
            ));
            let _ = std::fs::write(&keep, &log);
            eprintln!("console kept at {}", keep.display());
            // And the appliance's log beside it.
            if let Some(dir) = console.parent() {
                let kept = keep.with_extension("serve.log");
                if std::fs::copy(dir.join("serve.log"), &kept).is_ok() {
                    eprintln!("the appliance's log kept at {}", kept.display());
                }
            }
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            panic!(
                "timed out waiting for {what}; console tail:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// A swtpm for QEMU on the TPM state in `state` (`-tpmdev emulator`), and the QEMU arguments
/// that give it to a VM as a TIS TPM.
fn vm_tpm(state: &Path) -> (Killed, Vec<String>) {
    let sock = state.join("ctrl.sock");
    let swtpm = Killed(
        Command::new("swtpm")
            .args(["socket", "--tpm2", "--tpmstate"])
            .arg(format!("dir={}", state.display()))
            .arg("--ctrl")
            .arg(format!("type=unixio,path={}", sock.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let t = Instant::now();
    while !sock.exists() {
        assert!(t.elapsed() < Duration::from_secs(10), "swtpm did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let args = vec![
        "-chardev".into(),
        format!("socket,id=chrtpm,path={}", sock.display()),
        "-tpmdev".into(),
        "emulator,id=tpm0,chardev=chrtpm".into(),
        "-device".into(),
        "tpm-tis,tpmdev=tpm0".into(),
    ];
    (swtpm, args)
}

/// The first node in `pool`, waited for (`secs` at most; the console's tail on a timeout).
fn first_node(a: &Appliance, pool: &str, secs: u64, console: &Path) -> Value {
    wait_for("the ramdisk node", secs, console, || {
        a.cli_json(&["nodes", "list", "--pool", pool])["items"]
            .as_array()
            .unwrap()
            .first()
            .cloned()
    })
}

/// The whole story for one VM: boot, ask, approval, join as ramdisk.
fn boot_and_approve(ns: &Netns, a: &Appliance, mac: &str, uefi: bool) {
    boot_and_approve_with(ns, a, mac, uefi, &[])
}

fn boot_and_approve_with(ns: &Netns, a: &Appliance, mac: &str, uefi: bool, extra: &[String]) {
    let pool = a.pool(&format!("intake-{}", rand_hex(2)));
    let (_vm, console) = vm_with(ns, a, mac, uefi, extra);
    let req = wait_for("the VM's join request", 300, &console, || {
        crate::discovery::pending(a, mac)
    });
    assert_eq!(req["attestor"], "discovery");
    assert!(req["ip"].as_str().unwrap().starts_with(&ns.net), "{req}");
    let id = req["id"].as_str().unwrap();
    a.cli_json(&[
        "join-requests",
        "approve",
        id,
        "--pool",
        &pool,
        "--reason",
        "rack intake",
    ]);
    let node = first_node(a, &pool, 120, &console);
    assert_eq!(node["role"], "ramdisk");
    wait_for("the ramdisk's session", 60, &console, || {
        (a.cli_json(&["nodes", "get", node["id"].as_str().unwrap()])["connected"] == true)
            .then_some(())
    });
    let log = std::fs::read_to_string(&console).unwrap();
    assert!(log.contains("bca: joined"), "{log}");
    // No token of any kind appears in the appliance's log.
    let serve_log = std::fs::read_to_string(a.dir.path().join("serve.log")).unwrap();
    assert!(serve_log.contains("boot: discovery ramdisk"), "{serve_log}");
    assert!(!serve_log.contains("bcjt_"), "a token leaked into the log");
    let leases = a.cli_json(&["boot", "leases", "--mac", mac]);
    let stages: Vec<&str> = leases["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l["stage"].as_str())
        .collect();
    assert!(stages.contains(&"script"), "{stages:?}");
}

/// QEMU arguments for OVMF with Secure Boot enforced: Debian's `.ms` pair (its variables hold
/// Microsoft's UEFI CA, and Secure Boot is on), on `q35` with SMM and the secure flash the
/// firmware requires. A fresh copy of the variables per VM (`tag`).
fn secure_boot(a: &Appliance, tag: &str) -> Vec<String> {
    let vars = a.dir.path().join(format!("OVMF_VARS-{tag}.ms.fd"));
    std::fs::copy("/usr/share/OVMF/OVMF_VARS_4M.ms.fd", &vars).unwrap();
    [
        "-machine",
        "q35,smm=on",
        "-global",
        "driver=cfi.pflash01,property=secure,value=on",
        // No iPXE option ROM on the NIC (QEMU's default on q35): the firmware's own network
        // stack boots, as on a server whose NIC carries no iPXE.
        "-global",
        "virtio-net-pci.romfile=",
        "-drive",
        "if=pflash,format=raw,unit=0,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.ms.fd",
        "-drive",
    ]
    .into_iter()
    .map(String::from)
    .chain([format!(
        "if=pflash,format=raw,unit=1,file={}",
        vars.display()
    )])
    .collect()
}

/// Whether the console in `path` says `what` yet.
fn console_says(path: &Path, what: &str) -> Option<()> {
    std::fs::read_to_string(path)
        .ok()
        .filter(|l| l.contains(what))
        .map(|_| ())
}

fn require_tools() {
    for t in ["qemu-system-x86_64", "ip"] {
        assert!(
            Command::new("sh")
                .arg("-c")
                .arg(format!("command -v {t}"))
                .status()
                .unwrap()
                .success(),
            "{t} is missing: run make deps"
        );
    }
    assert!(
        image().join("initrd.img").exists(),
        "image/out/initrd.img is missing: run make image"
    );
}

#[test]
fn a_vm_pxe_boots_with_seabios_and_is_approved() {
    require_tools();
    let _vm = vm_lock();
    let ns = Netns::new("bios", 99);
    let a = appliance(&ns, "dhcp");
    boot_and_approve(&ns, &a, "52:54:00:b1:05:01", false);
}

#[test]
fn a_vm_pxe_boots_with_ovmf_and_is_approved() {
    require_tools();
    let _vm = vm_lock();
    let ns = Netns::new("uefi", 98);
    let a = appliance(&ns, "dhcp");
    // With a TPM whose EK is on no list: the ramdisk tries it (--no-enroll), is refused, and
    // falls back to its discovery token; the operator sees one request, discovery's.
    let state = a.dir.path().join("vtpm");
    std::fs::create_dir(&state).unwrap();
    let (_swtpm, tpm) = vm_tpm(&state);
    boot_and_approve_with(&ns, &a, "52:54:00:ef:10:01", true, &tpm);
    let log = std::fs::read_to_string(a.dir.path().join("console-525400ef1001.log")).unwrap();
    assert!(log.contains("bca: joining with the TPM"), "{log}");
    let (_, ev) = a.last_event("security.join.refused").unwrap();
    assert_eq!(ev["reason"], "tpm:ek-unknown");
    assert_eq!(
        a.count("SELECT count(*) FROM join_requests WHERE attestor = 'tpm'"),
        0
    );
}

/// Secure Boot enforced by the firmware (Microsoft's UEFI CA enrolled, as on a server off the
/// shelf). The switch this test flips is `[boot] uefi_chain`: with `ipxe` (the default) the
/// firmware refuses the unsigned iPXE bca hands it ("Access Denied") and nothing asks to join;
/// with `shim` the machine boots Debian's signed shim over TFTP, shim the signed network GRUB
/// beside it, GRUB the per-machine configuration and the signed kernel and ramdisk over HTTP; the
/// ramdisk reads Secure Boot as enabled, asks, is approved, and joins.
#[test]
fn a_vm_with_secure_boot_enforced_boots_the_signed_chain_and_is_approved() {
    require_tools();
    let _vm = vm_lock();
    let ns = Netns::new("sb", 92);
    let a = appliance(&ns, "dhcp");
    let refused = "52:54:00:5b:00:01";
    let (vm, console) = vm_with(&ns, &a, refused, false, &secure_boot(&a, "ipxe"));
    wait_for(
        "the firmware's refusal of unsigned iPXE",
        240,
        &console,
        || console_says(&console, "Access Denied"),
    );
    drop(vm);
    let log = std::fs::read_to_string(&console).unwrap();
    assert!(!log.contains("bca: network on"), "{log}");
    let serve_log = std::fs::read_to_string(a.dir.path().join("serve.log")).unwrap();
    assert!(serve_log.contains("snponly.efi"), "{serve_log}");
    assert!(crate::discovery::pending(&a, refused).is_none());
    drop(a);

    // On port 80: Debian 12's GRUB (2.06) names no port in an `(http,…)` device.
    let a = appliance_cfg_http(&ns, "dhcp", 80, |t| {
        t.replace("[boot]\n", "[boot]\nuefi_chain = \"shim\"\n")
    });
    let mac = "52:54:00:5b:00:02";
    boot_and_approve_with(&ns, &a, mac, false, &secure_boot(&a, "shim"));
    let console = a.dir.path().join("console-5254005b0002.log");
    let log = std::fs::read_to_string(&console).unwrap();
    assert!(log.contains(&format!("bca: GRUB for {mac}")), "{log}");
    assert!(log.contains("bca: Secure Boot: enabled"), "{log}");
    // The firmware fetched shim from bca's TFTP, shim GRUB, and GRUB its configuration, the
    // machine's own, the kernel and the per-boot initrd (all over TFTP: Debian's signed network
    // GRUB has no HTTP module, and Secure Boot lets it load none). The per-boot name's nonce is
    // not logged.
    let serve_log = std::fs::read_to_string(a.dir.path().join("serve.log")).unwrap();
    for f in [
        "shimx64.efi",
        "grubx64.efi",
        "/grub/grub.cfg",
        &format!("/grub/{mac}.cfg"),
        "/vmlinuz",
        "/per-boot/<nonce>/initrd.img",
    ] {
        assert!(
            serve_log.contains(&format!("tftp: sent peer={}.", ns.net))
                && serve_log.contains(&format!("file={f}")),
            "{f}: {serve_log}"
        );
    }
}

/// UEFI HTTP boot with no TFTP at all: the appliance serves none (`[boot] listen_tftp = "off"`;
/// the test shows nothing answers TFTP in the namespace), OVMF's PXE is switched off through its
/// fw_cfg knobs (`opt/org.tianocore/IPv4PXESupport` and `IPv6PXESupport`), so the firmware goes
/// straight to its HTTPv4 boot option: it asks as `HTTPClient` (architecture 16), gets
/// `http://…/boot/files/ipxe.efi`, and iPXE gets its chain script over HTTP too. The switch is
/// bca's answer to `HTTPClient`: without `ipxe.efi` in the boot root the appliance has none, and
/// the machine never asks to join.
#[test]
fn a_vm_uefi_http_boots_with_no_tftp_and_is_approved() {
    require_tools();
    let _vm = vm_lock();
    let ns = Netns::new("http", 91);
    let a = appliance_cfg(&ns, "dhcp", |t| {
        t.replace("[boot]\n", "[boot]\nlisten_tftp = \"off\"\n")
    });
    // Nothing answers TFTP on the provisioning network: curl's request is refused.
    let probe = ns
        .cmd("curl")
        .args(["-sS", "--max-time", "5"])
        .arg(format!("tftp://{}/chain.ipxe", ns.ip()))
        .output()
        .unwrap();
    assert!(!probe.status.success(), "something answered TFTP");
    let mac = "52:54:00:47:70:01";
    let no_pxe = [
        // No iPXE option ROM on the NIC either (it would boot before the firmware's own stack).
        "-global",
        "virtio-net-pci.romfile=",
        "-fw_cfg",
        "name=opt/org.tianocore/IPv4PXESupport,string=no",
        "-fw_cfg",
        "name=opt/org.tianocore/IPv6PXESupport,string=no",
    ]
    .map(String::from);
    boot_and_approve_with(&ns, &a, mac, true, &no_pxe);
    let serve_log = std::fs::read_to_string(a.dir.path().join("serve.log")).unwrap();
    assert!(!serve_log.contains("tftp: sent"), "{serve_log}");
    let console = std::fs::read_to_string(a.dir.path().join("console-525400477001.log")).unwrap();
    // The firmware's own HTTP boot, no PXE and no NIC ROM, fetched iPXE.
    assert!(console.contains(">>Start HTTP Boot over IPv4"), "{console}");
    assert!(!console.contains(">>Start PXE"), "{console}");
    let leases = a.cli_json(&["boot", "leases", "--mac", mac]);
    let firmware = leases["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["arch"] == 16)
        .unwrap_or_else(|| panic!("no HTTPClient lease: {leases}"));
    assert!(
        firmware["file"]
            .as_str()
            .unwrap()
            .ends_with("/api/compute/boot/files/ipxe.efi"),
        "{firmware}"
    );
}

/// A VM with a TPM (swtpm behind QEMU's `-tpmdev emulator`) whose EK an operator allowed into a
/// pool: its ramdisk joins with `--attestor tpm`, no join request, no token spent, the node key
/// made in the VM's TPM.
#[test]
fn a_vm_with_a_tpm_pxe_boots_and_joins_with_its_tpm_when_its_ek_is_allowed() {
    require_tools();
    let _vm = vm_lock();
    let ns = Netns::new("vtpm", 97);
    let a = appliance(&ns, "dhcp");
    let pool = a.pool("tpm-rack");
    // The operator reads the EK's hash from the TPM (here over swtpm's TCP server on the state
    // the VM's swtpm then serves: the same seeds, the same EK).
    let state = a.dir.path().join("vtpm");
    std::fs::create_dir(&state).unwrap();
    let hash = {
        let t = crate::tpm::Swtpm::start_at(&state, true);
        crate::tpmjoin::allow_ek(&a, &t.tcti(), &pool).0
    };
    let (_swtpm, tpm) = vm_tpm(&state);
    let mac = "52:54:00:79:70:01";
    let (_vm, console) = vm_with(&ns, &a, mac, false, &tpm);
    let node = first_node(&a, &pool, 300, &console);
    assert_eq!(node["role"], "ramdisk");
    let id = node["id"].as_str().unwrap().to_string();
    wait_for("the ramdisk's session", 60, &console, || {
        (a.cli_json(&["nodes", "get", &id])["connected"] == true).then_some(())
    });
    let (_, ev) = a.last_event("node.joined").unwrap();
    assert_eq!(ev["attestor"], "tpm");
    assert_eq!(ev["nodeKey"], "tpm");
    assert_eq!(ev["ekSha256"], hash.as_str());
    assert_eq!(a.count("SELECT count(*) FROM join_requests"), 0);
    let log = std::fs::read_to_string(&console).unwrap();
    assert!(log.contains("bca: joining with the TPM"), "{log}");
    assert!(log.contains("bca: joined"), "{log}");
    // The certificate names the VM's AK.
    let cert: String = a
        .db()
        .query_row(
            "SELECT hex(der) FROM node_certs WHERE node_id = ?1",
            [&id],
            |r| r.get(0),
        )
        .unwrap();
    let der: Vec<u8> = (0..cert.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&cert[i..i + 2], 16).unwrap())
        .collect();
    let leaf = bca::proto::x509::parse_node_leaf(&der).unwrap();
    assert_eq!(leaf.statements.len(), 1);
    assert!(leaf.statements[0].starts_with("urn:bc:tpm-ak:sha256:"));
}

/// The site's own DHCP server (dnsmasq) in a namespace of its own, on the same wire as the
/// appliance: it gives addresses, bca only boot information (proxyDHCP).
struct SiteDhcp {
    ns: String,
    _dnsmasq: Killed,
}

impl Drop for SiteDhcp {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

fn site_dhcp(prov: &Netns, dir: &Path) -> SiteDhcp {
    let site = format!("bca-site-{}", rand_hex(3));
    let net = &prov.net;
    sh(&format!("ip netns add {site}"));
    sh(&format!("ip -n {site} link set lo up"));
    sh(&format!(
        "ip -n {} link add vs0 type veth peer name vs1 netns {site}",
        prov.name
    ));
    sh(&format!("ip -n {} link set vs0 master br0", prov.name));
    sh(&format!("ip -n {} link set vs0 up", prov.name));
    sh(&format!("ip -n {site} addr add {net}.2/24 dev vs1"));
    sh(&format!("ip -n {site} link set vs1 up"));
    let child = Command::new("ip")
        .args([
            "netns",
            "exec",
            &site,
            "dnsmasq",
            "--no-daemon",
            "--port=0",
            "--interface=vs1",
            "--bind-interfaces",
        ])
        .arg(format!("--dhcp-range={net}.160,{net}.190,255.255.255.0,1h"))
        .arg(format!(
            "--dhcp-leasefile={}",
            dir.join("dnsmasq.leases").display()
        ))
        .args([
            "--conf-file=/dev/null",
            "--no-resolv",
            "--log-dhcp",
            "--user=root",
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("dnsmasq.log")).unwrap())
        .spawn()
        .unwrap();
    SiteDhcp {
        ns: site,
        _dnsmasq: Killed(child),
    }
}

#[test]
fn a_vm_pxe_boots_through_proxy_dhcp_beside_the_sites_dhcp_server() {
    require_tools();
    let _vm = vm_lock();
    let ns = Netns::new("proxy", 97);
    let a = appliance(&ns, "proxy");
    let _site = site_dhcp(&ns, a.dir.path());
    boot_and_approve(&ns, &a, "52:54:00:9a:0c:01", false);
    // The address came from the site's server (its range), the boot from bca.
    let leases = std::fs::read_to_string(a.dir.path().join("dnsmasq.leases")).unwrap();
    assert!(leases.contains("52:54:00:9a:0c:01"), "{leases}");
    let node = a.cli_json(&["join-requests", "list", "--state", "all"])["items"][0].clone();
    let ip = node["ip"].as_str().unwrap();
    let last: u8 = ip.rsplit('.').next().unwrap().parse().unwrap();
    assert!(
        (160..=190).contains(&last),
        "{ip} is not from the site's range"
    );
}

/// A provisioning network behind a router: the router namespace holds the VM's network (its
/// bridge, `router.net`, the relay at `relay_ip`) and a veth to the rack namespace, where bca (and,
/// for the proxy test, the site's DHCP server) live; the router has `up` on that link, bca
/// `bca_ip` on `vb`.
struct Routed {
    router: Netns,
    rack: Netns,
    relay_ip: String,
    up: String,
    bca_ip: String,
    vb: String,
    vr: String,
}

impl Routed {
    fn new(tag: &str, octet: u8) -> Self {
        let router = Netns::new(tag, octet);
        let rack = Netns::bare(
            "rack",
            format!("10.{}.{}", octet - 1, 10 + (std::process::id() % 200)),
        );
        let (relay_ip, up, bca_ip) = (
            router.ip(),
            format!("{}.1", rack.net),
            format!("{}.2", rack.net),
        );
        let (vr, vb) = (format!("vr{}", rand_hex(3)), format!("vb{}", rand_hex(3)));
        sh(&format!(
            "ip -n {} link add {vr} type veth peer name {vb} netns {}",
            router.name, rack.name
        ));
        sh(&format!("ip -n {} addr add {up}/24 dev {vr}", router.name));
        sh(&format!("ip -n {} link set {vr} up", router.name));
        sh(&format!(
            "ip -n {} addr add {bca_ip}/24 dev {vb}",
            rack.name
        ));
        sh(&format!("ip -n {} link set {vb} up", rack.name));
        sh(&format!(
            "ip -n {} route add {}.0/24 via {up}",
            rack.name, router.net
        ));
        sh(&format!(
            "ip netns exec {} sysctl -qw net.ipv4.ip_forward=1",
            router.name
        ));
        Routed {
            router,
            rack,
            relay_ip,
            up,
            bca_ip,
            vb,
            vr,
        }
    }

    /// dnsmasq as a DHCP relay in the router, relaying the VM network's requests to each of
    /// `servers`; its log in `dir/relay.log`.
    fn relay(&self, dir: &Path, servers: &[&str]) -> Killed {
        let mut c = self.router.cmd("dnsmasq");
        c.args([
            "--no-daemon",
            "--port=0",
            "--interface=br0",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--log-dhcp",
            "--user=root",
        ])
        // The servers' answers come back on the link toward the rack.
        .arg(format!("--interface={}", self.vr));
        for s in servers {
            c.arg(format!("--dhcp-relay={},{s}", self.relay_ip));
        }
        Killed(
            c.arg(format!("--pid-file={}", dir.join("relay.pid").display()))
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join("relay.log")).unwrap())
                .spawn()
                .unwrap(),
        )
    }
}

/// A provisioning network behind a router: the VM on the router's bridge (its network
/// `10.95.x`), a real DHCP relay there (dnsmasq `--dhcp-relay`, forwarding to bca with `giaddr`
/// the router's address on the VM's network), and bca in a namespace of its own on another network
/// (`10.94.x`), reached through the router. bca in full DHCP mode leases from the relay's
/// `[[boot.subnets]]` range and answers to the relay; the VM boots, asks, is approved and joins
/// through the router; its boot lease records the relay. Switch: without the subnet (or without
/// the relay listed) bca gives the relayed DISCOVER nothing, and the VM never asks.
#[test]
fn a_vm_pxe_boots_through_a_dhcp_relay_and_joins_across_the_router() {
    require_tools();
    let _vm = vm_lock();
    let r = Routed::new("relay", 95);
    let (router, rack) = (&r.router, &r.rack);
    let (relay_ip, up, bca_ip, vb) = (&r.relay_ip, &r.up, &r.bca_ip, &r.vb);
    let net = &router.net;
    // The relay's packets come from its address toward bca, with its address on the VM's
    // network as giaddr: both are listed.
    let boot = format!(
        "[boot]\nenabled = true\nmode = \"dhcp\"\ninterface = \"{vb}\"\nserver_ip = \"{bca_ip}\"\n\
         kernel_args = \"console=ttyS0\"\nrelays = [\"{relay_ip}\", \"{up}\"]\n\n\
         [[boot.subnets]]\nrelay = \"{relay_ip}\"\nrange_start = \"{net}.100\"\nrange_end = \"{net}.150\"\n\
         netmask = \"255.255.255.0\"\nrouter = \"{relay_ip}\"\n"
    );
    let a = appliance_in(rack, bca_ip, &boot, |t| t);
    let dir = a.dir.path().to_path_buf();
    let _relay = r.relay(&dir, &[bca_ip]);
    let mac = "52:54:00:4e:1a:01";
    boot_and_approve(router, &a, mac, false);
    // The address is from the relay's subnet, the lease names the relay, and the relay relayed.
    let leases = a.cli_json(&["boot", "leases", "--mac", mac]);
    let items = leases["items"].as_array().unwrap();
    assert!(
        items.iter().any(|l| l["relay"] == relay_ip.as_str()
            && l["ip"].as_str().unwrap().starts_with(net.as_str())),
        "{leases}; relay's log: {}",
        std::fs::read_to_string(dir.join("relay.log")).unwrap_or_default()
    );
}

/// Two appliances of one site on one PostgreSQL, on one provisioning network: A serves the boot
/// (full DHCP, TFTP, HTTP), B only its gateway (joined with `join-site`, approved on A). The VM
/// boots from A and asks through A (its archive lists both gateways); the operator approves on B;
/// A goes down; the ramdisk fails over to B and is admitted there, and holds its session on B.
#[test]
fn a_vm_booted_by_one_appliance_joins_through_the_other() {
    require_tools();
    let _vm = vm_lock();
    let ns = Netns::new("two", 93);
    let net = ns.net.clone();
    let (ip_a, ip_b) = (ns.ip(), format!("{net}.2"));
    sh(&format!("ip -n {} addr add {ip_b}/24 dev br0", ns.name));
    let url = bca::store::pg_cluster::Cluster::shared().new_database();
    let boot = format!(
        "[boot]\nenabled = true\nmode = \"dhcp\"\ninterface = \"br0\"\nserver_ip = \"{ip_a}\"\nrange_start = \"{net}.100\"\n\
         range_end = \"{net}.150\"\nnetmask = \"255.255.255.0\"\nkernel_args = \"console=ttyS0\"\n"
    );
    let mut a = appliance_init(&ns, &ip_a, 8080, &boot, &["--store", &url], |t| {
        t.replace("retry_after_seconds = 30", "retry_after_seconds = 2")
    });
    // B: joined, approved with the fingerprint it printed, serving its gateway on the same wire.
    let b_dir = tempfile::tempdir().unwrap();
    let b_state = b_dir.path().join("state");
    let pin = a.cli_json(&["pki", "show"])["pins"]["servingCa"]
        .as_str()
        .unwrap()
        .to_string();
    let o = Command::new(bin())
        .args(["join-site", "--store", &url, "--serving-ca-pin", &pin])
        .args(["--key-protection", "file", "--gateway-san", &ip_b])
        .args(["--gateway-url", &format!("https://{ip_b}:8443"), "--json"])
        .arg("--state-dir")
        .arg(&b_state)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let joined: Value = serde_json::from_slice(&o.stdout).unwrap();
    let b_id = joined["id"].as_str().unwrap().to_string();
    a.cli_json(&[
        "site",
        "appliances",
        "approve",
        &b_id,
        "--fingerprint",
        joined["fingerprint"].as_str().unwrap(),
    ]);
    let b = serve_in(&ns, b_dir, &ip_b, 8080);

    let mac = "52:54:00:7e:0b:01";
    let pool = a.pool("intake");
    let (_vm, console) = vm_with(&ns, &a, mac, false, &[]);
    let req = wait_for("the VM's join request", 300, &console, || {
        crate::discovery::pending(&a, mac)
    });
    // Approved on B, then A goes down: the ramdisk's next ask reaches B.
    b.cli_json(&[
        "join-requests",
        "approve",
        req["id"].as_str().unwrap(),
        "--pool",
        &pool,
    ]);
    a.stop();
    let node = wait_for("the node, through B", 120, &console, || {
        b.cli_json(&["nodes", "list", "--pool", &pool])["items"]
            .as_array()
            .unwrap()
            .first()
            .cloned()
    });
    assert_eq!(node["role"], "ramdisk");
    let id = node["id"].as_str().unwrap().to_string();
    wait_for("the ramdisk's session on B", 60, &console, || {
        (b.cli_json(&["nodes", "get", &id])["connected"] == true).then_some(())
    });
    let held = b.live().count(&format!(
        "SELECT count(*) FROM nodes WHERE id = '{id}' AND session_appliance = '{b_id}'"
    ));
    assert_eq!(held, 1, "the session is B's");
}

/// The "installed OS" of the whole-life test: the same machine (MAC, SMBIOS) booted from its
/// disk, here the ramdisk's kernel and initramfs started directly with `bca.os` (image/init),
/// reading the deploy's user data from the disk.
fn vm_os(ns: &Netns, a: &Appliance, mac: &str, disk: &Path) -> (Killed, PathBuf) {
    let console = a.dir.path().join("console-os.log");
    let child = qemu(ns, mac, &console)
        .arg("-kernel")
        .arg(image().join("vmlinuz"))
        .arg("-initrd")
        .arg(image().join("initrd.img"))
        .args(["-append", "console=ttyS0 bca.os"])
        .arg("-drive")
        .arg(format!("file={},format=raw,if=virtio", disk.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    (Killed(child), console)
}

fn node_events(a: &Appliance, node: &str, kind: &str) -> Vec<Value> {
    let c = a.db();
    let mut st = c
        .prepare("SELECT data FROM events WHERE type = ?1 ORDER BY seq")
        .unwrap();
    st.query_map([kind], |r| r.get::<_, String>(0))
        .unwrap()
        .map(|d| serde_json::from_str::<Value>(&d.unwrap()).unwrap())
        .filter(|d| d["nodeId"] == node)
        .collect()
}

/// A machine's whole life, with real firmware and the real ramdisk: discovered by PXE and
/// approved (a `ramdisk` node); a provisioned token minted for the OS a deploy installs; the
/// machine's next network boot told to boot its local disk; the "installed OS" joining with the
/// token as the same node (role `node`); its certificate renewed; then offline past its
/// certificate's expiry, and back through `x509pop`.
#[test]
fn a_vm_lives_its_whole_life_discovered_provisioned_renewed_and_back_by_x509pop() {
    require_tools();
    let _vm = vm_lock();
    let ns = Netns::new("life", 96);
    let a = appliance_cfg(&ns, "dhcp", |t| {
        let t = t.replace("cert_ttl_seconds = 86400", "cert_ttl_seconds = 60");
        replace_table(
            &t,
            "x509pop",
            "[x509pop]\nenabled = true\nmax_expired_seconds = 604800\n\n",
        )
    });
    let pool = a.pool("life");
    let mac = "52:54:00:11:fe:01";
    let disk = a.dir.path().join("disk.img");
    std::fs::write(&disk, vec![0u8; 4 << 20]).unwrap();
    let drive = vec![
        "-drive".to_string(),
        format!("file={},format=raw,if=virtio", disk.display()),
    ];

    // Discovered and approved: a ramdisk node.
    let (vm, console) = vm_with(&ns, &a, mac, false, &drive);
    let req = wait_for("the VM's join request", 300, &console, || {
        crate::discovery::pending(&a, mac)
    });
    a.cli_json(&[
        "join-requests",
        "approve",
        req["id"].as_str().unwrap(),
        "--pool",
        &pool,
    ]);
    let node = first_node(&a, &pool, 120, &console);
    let id = node["id"].as_str().unwrap().to_string();
    assert_eq!(node["role"], "ramdisk");
    assert_eq!(node["hardwareKeyTrusted"], true);
    wait_for("the ramdisk's session", 60, &console, || {
        (a.cli_json(&["nodes", "get", &id])["connected"] == true).then_some(())
    });

    // The deploy's token for the OS, and the machine's next network boot: its local disk.
    let token = a.dir.path().join("provision-token");
    let o = a.cli(&[
        "nodes",
        "provision-token",
        &id,
        "--ttl",
        "1h",
        "--out",
        token.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    drop(vm);
    let serve_log = || std::fs::read_to_string(a.dir.path().join("serve.log")).unwrap();
    let local = |l: &str| l.contains("boot: local disk") && l.contains(mac);
    assert!(!serve_log().lines().any(local));
    let (vm, console) = vm_with(&ns, &a, mac, false, &drive);
    wait_for("the local-disk script", 300, &console, || {
        serve_log().lines().any(local).then_some(())
    });
    drop(vm);

    // The deploy writes the OS's user data to the disk: the agent's files, the node id, the
    // token (0600), as a newc archive at the disk's start.
    let data = a.dir.path().join("user-data");
    let etc = data.join("etc/bca-agent");
    std::fs::create_dir_all(&etc).unwrap();
    let agent = a.agent_dir();
    for f in std::fs::read_dir(&agent).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), etc.join(f.file_name())).unwrap();
    }
    std::fs::write(etc.join("node-id"), &id).unwrap();
    std::fs::copy(&token, etc.join("provision-token")).unwrap();
    std::fs::set_permissions(
        etc.join("provision-token"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    sh(&format!(
        "cd {} && find etc | cpio -o -H newc --quiet | dd of={} conv=notrunc status=none",
        data.display(),
        disk.display()
    ));

    // The installed OS joins with it as the same node.
    let (_os, console) = vm_os(&ns, &a, mac, &disk);
    wait_for("the OS's join", 300, &console, || {
        (a.cli_json(&["nodes", "get", &id])["role"] == "node").then_some(())
    });
    let n = a.cli_json(&["nodes", "get", &id]);
    assert_eq!(n["identityGeneration"], 2);
    assert_eq!(node_events(&a, &id, "node.provisioned").len(), 1);
    wait_for("the OS's session", 120, &console, || {
        (a.cli_json(&["nodes", "get", &id])["connected"] == true).then_some(())
    });
    let log = std::fs::read_to_string(&console).unwrap();
    assert!(log.contains("bca: OS joined"), "{log}");

    // Renewed at about 60% of its 60 s certificate.
    wait_for("a renewal", 120, &console, || {
        (!node_events(&a, &id, "node.renewed").is_empty()).then_some(())
    });

    // Offline past its certificate's expiry: the tap down, the certificate lapses.
    let newest = a.cli_json(&["nodes", "get", &id])["certificates"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["revokedAt"].is_null())
        .filter_map(|c| c["notAfter"].as_str().map(str::to_string))
        .max()
        .unwrap();
    sh(&format!("ip -n {} link set tap0 down", ns.name));
    let until =
        time::OffsetDateTime::parse(&newest, &time::format_description::well_known::Rfc3339)
            .unwrap()
            .unix_timestamp();
    while bca::base::clock::now() <= until + 2 {
        std::thread::sleep(Duration::from_secs(1));
    }
    assert!(node_events(&a, &id, "node.joined")
        .iter()
        .all(|e| e["attestor"] != "x509pop"));
    sh(&format!("ip -n {} link set tap0 up", ns.name));

    // Back through x509pop: the same node and generation, a session again.
    wait_for("the x509pop re-join", 240, &console, || {
        node_events(&a, &id, "node.joined")
            .iter()
            .any(|e| e["attestor"] == "x509pop")
            .then_some(())
    });
    let n = a.cli_json(&["nodes", "get", &id]);
    assert_eq!(n["identityGeneration"], 2);
    assert_eq!(n["role"], "node");
    wait_for("the session after x509pop", 120, &console, || {
        (a.cli_json(&["nodes", "get", &id])["connected"] == true).then_some(())
    });
    let log = std::fs::read_to_string(&console).unwrap();
    assert!(
        log.contains("the expired certificate was replaced by an x509pop re-join"),
        "{log}"
    );
}
