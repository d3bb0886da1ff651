//! The iPXE scripts (and GRUB configurations) the boot server hands out, rendered from templates: the files in `pxe/` are
//! built into the binary, and an operator's file of the same name under `<boot root>/templates/`
//! replaces the built-in one (read at each use, so an edit needs no restart; a file larger than
//! 64 KiB, or a link leading out of the boot root, is ignored).
//!
//! The override lives in `templates/` rather than beside the served files because the boot
//! root's top level is what TFTP and `GET …/boot/files/<name>` serve, and `chain.ipxe` there is
//! itself a rendered output (written at start). A template names its values as `{{name}}`; a
//! name the script does not supply is left as written, so a typo shows in the script iPXE prints.

use crate::base::fsutil::ReadRoot;
use std::io::Read;
use std::path::Path;

/// The templates, by the file name an operator's override uses.
pub const CHAIN: (&str, &str) = ("chain.ipxe", include_str!("../../../pxe/chain.ipxe"));
pub const DISCOVERY: (&str, &str) = (
    "discovery.ipxe",
    include_str!("../../../pxe/discovery.ipxe"),
);
pub const LOCAL_DISK: (&str, &str) = (
    "local-disk.ipxe",
    include_str!("../../../pxe/local-disk.ipxe"),
);
/// The GRUB configurations of the Secure Boot chain (`[boot] uefi_chain = "shim"`): the one GRUB
/// reads over TFTP, and the per-machine ones it fetches over HTTP, with the iPXE scripts' decisions.
pub const CHAIN_GRUB: (&str, &str) = ("chain.grub", include_str!("../../../pxe/chain.grub"));
pub const DISCOVERY_GRUB: (&str, &str) = (
    "discovery.grub",
    include_str!("../../../pxe/discovery.grub"),
);
pub const LOCAL_DISK_GRUB: (&str, &str) = (
    "local-disk.grub",
    include_str!("../../../pxe/local-disk.grub"),
);
pub const NEEDS_MAC: (&str, &str) = (
    "needs-mac.ipxe",
    include_str!("../../../pxe/needs-mac.ipxe"),
);

/// An override is a script, not a payload: larger files are ignored (with a warning).
const MAX_OVERRIDE: u64 = 64 * 1024;

/// The template `(name, built-in)`, from `templates/<name>` beneath `root` when that is a
/// regular file of at most 64 KiB, rendered with `values`. The override is opened beneath the
/// root (no symlink out of it), like every file the boot server serves.
pub fn render(root: &ReadRoot, template: (&str, &str), values: &[(&str, &str)]) -> String {
    let (name, builtin) = template;
    let rel = Path::new("templates").join(name);
    let text = match root.open_file(&rel) {
        Ok(f) => {
            let mut t = String::new();
            match f.take(MAX_OVERRIDE + 1).read_to_string(&mut t) {
                Ok(n) if n as u64 <= MAX_OVERRIDE => t,
                Ok(_) => {
                    tracing::warn!(path = %root.path().join(&rel).display(), "boot: template override larger than 64 KiB; using the built-in one");
                    builtin.to_string()
                }
                Err(e) => {
                    tracing::warn!(path = %root.path().join(&rel).display(), error = %e, "boot: template override unreadable; using the built-in one");
                    builtin.to_string()
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => builtin.to_string(),
        Err(e) => {
            // A link that leads out of the boot root (or is absolute), a folder, a FIFO: named.
            tracing::warn!(path = %root.path().join(&rel).display(), error = %e, "boot: template override not opened beneath the boot root; using the built-in one");
            builtin.to_string()
        }
    };
    fill(&text, values)
}

/// Replaces each `{{name}}` of `values` in `text`.
fn fill(text: &str, values: &[(&str, &str)]) -> String {
    values.iter().fold(text.to_string(), |t, (k, v)| {
        t.replace(&format!("{{{{{k}}}}}", k = k), v)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_templates_render_every_value_they_name() {
        let dir = tempfile::tempdir().unwrap();
        let root = ReadRoot::open(dir.path()).unwrap();
        let s = render(
            &root,
            DISCOVERY,
            &[
                ("mac", "52:54:00:00:00:01"),
                ("base", "http://10.0.0.1"),
                ("base_path", "/api/compute"),
                ("kernel_args", "console=ttyS0"),
                ("nonce", "00ff"),
            ],
        );
        assert!(!s.contains("{{"), "{s}");
        assert!(s.starts_with("#!ipxe\n"));
        assert!(s.contains("kernel http://10.0.0.1/api/compute/boot/files/vmlinuz console=ttyS0"));
        assert!(s.contains("/boot/per-boot/00ff/initrd.img"));
    }

    #[test]
    fn the_grub_configurations_render_every_value_they_name() {
        let dir = tempfile::tempdir().unwrap();
        let root = ReadRoot::open(dir.path()).unwrap();
        let s = render(
            &root,
            DISCOVERY_GRUB,
            &[
                ("mac", "52:54:00:00:00:01"),
                ("base", "(tftp,10.0.0.1)"),
                ("kernel_args", "console=ttyS0"),
                ("nonce", "00ff"),
            ],
        );
        assert!(!s.contains("{{"), "{s}");
        assert!(s.contains("linux (tftp,10.0.0.1)/vmlinuz console=ttyS0\n"));
        assert!(s.contains("initrd (tftp,10.0.0.1)/per-boot/00ff/initrd.img"));
        let c = render(&root, CHAIN_GRUB, &[("base", "(tftp,10.0.0.1)")]);
        assert!(!c.contains("{{"), "{c}");
        assert!(c.contains("configfile (tftp,10.0.0.1)/grub/${net_default_mac}.cfg"));
    }

    #[test]
    fn an_override_replaces_the_built_in_and_a_bad_one_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("templates")).unwrap();
        let root = ReadRoot::open(dir.path()).unwrap();
        let p = dir.path().join("templates/local-disk.ipxe");
        std::fs::write(&p, "#!ipxe\nexit 0 # {{unknown}}\n").unwrap();
        assert_eq!(
            render(&root, LOCAL_DISK, &[]),
            "#!ipxe\nexit 0 # {{unknown}}\n"
        );
        std::fs::write(&p, vec![b'#'; 70 * 1024]).unwrap();
        assert_eq!(render(&root, LOCAL_DISK, &[]), LOCAL_DISK.1);
        // A link out of the root is not followed: the built-in script is served.
        std::fs::remove_file(&p).unwrap();
        let secret = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(secret.path(), "secret").unwrap();
        std::os::unix::fs::symlink(secret.path(), &p).unwrap();
        assert_eq!(render(&root, LOCAL_DISK, &[]), LOCAL_DISK.1);
    }
}
