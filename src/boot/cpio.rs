//! A writer for the `newc` cpio format, the one the Linux kernel unpacks as an initramfs. The
//! per-boot archive is a second initrd the kernel merges over the ramdisk's.

pub struct Cpio {
    out: Vec<u8>,
    ino: u32,
}

impl Default for Cpio {
    fn default() -> Self {
        Self::new()
    }
}

impl Cpio {
    pub fn new() -> Self {
        Self {
            out: Vec::new(),
            ino: 1,
        }
    }

    fn header(&mut self, name: &str, mode: u32, size: usize) {
        let namesize = name.len() + 1;
        let fields = [
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            size as u32,
            0,
            0,
            0,
            0,
            namesize as u32,
            0,
        ];
        self.ino += 1;
        self.out.extend_from_slice(b"070701");
        for f in fields {
            self.out.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
    }

    fn pad(&mut self) {
        while self.out.len() % 4 != 0 {
            self.out.push(0);
        }
    }

    /// A directory (`mode` are the permission bits).
    pub fn dir(&mut self, name: &str, mode: u32) -> &mut Self {
        self.header(name, 0o040000 | mode, 0);
        self
    }

    /// A regular file.
    pub fn file(&mut self, name: &str, mode: u32, data: &[u8]) -> &mut Self {
        self.header(name, 0o100000 | mode, data.len());
        self.out.extend_from_slice(data);
        self.pad();
        self
    }

    pub fn finish(mut self) -> Vec<u8> {
        self.header("TRAILER!!!", 0, 0);
        while self.out.len() % 512 != 0 {
            self.out.push(0);
        }
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_layout() {
        let mut c = Cpio::new();
        c.dir("etc", 0o755).file("etc/a", 0o600, b"hello");
        let out = c.finish();
        assert!(out.starts_with(b"070701"));
        assert_eq!(out.len() % 512, 0);
        let text = String::from_utf8_lossy(&out);
        assert!(text.contains("etc/a\0"));
        assert!(text.contains("hello"));
        assert!(text.contains("TRAILER!!!"));
    }
}
