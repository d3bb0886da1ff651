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

/// One member of a newc archive.
#[derive(Debug, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub mode: u32,
    pub data: Vec<u8>,
}

/// Reads a newc archive (as [`Cpio`] writes it) up to its trailer; every malformation is an
/// error naming the offset.
pub fn read(buf: &[u8]) -> Result<Vec<Entry>, String> {
    let mut out = Vec::new();
    let mut at = 0usize;
    let align = |n: usize| n.div_ceil(4) * 4;
    loop {
        let h = buf
            .get(at..at + 110)
            .ok_or_else(|| format!("truncated header at byte {at}"))?;
        if &h[..6] != b"070701" {
            return Err(format!("no newc header at byte {at}"));
        }
        let field = |i: usize| -> Result<usize, String> {
            std::str::from_utf8(&h[6 + i * 8..14 + i * 8])
                .ok()
                .and_then(|s| u32::from_str_radix(s, 16).ok())
                .map(|v| v as usize)
                .ok_or_else(|| format!("bad header field at byte {at}"))
        };
        let (mode, size, namesize) = (field(1)?, field(6)?, field(11)?);
        let name_end = at + 110 + namesize;
        let name = buf
            .get(at + 110..name_end.saturating_sub(1))
            .filter(|_| namesize > 0)
            .ok_or_else(|| format!("truncated name at byte {at}"))?;
        let name =
            String::from_utf8(name.to_vec()).map_err(|_| format!("bad name at byte {at}"))?;
        let data_at = align(name_end);
        let data = buf
            .get(data_at..data_at + size)
            .ok_or_else(|| format!("truncated member {name}"))?;
        if name == "TRAILER!!!" {
            return Ok(out);
        }
        out.push(Entry {
            name,
            mode: mode as u32,
            data: data.to_vec(),
        });
        at = align(data_at + size);
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
        let back = read(&out).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(back[1].name, "etc/a");
        assert_eq!(back[1].mode, 0o100600);
        assert_eq!(back[1].data, b"hello");
        // Truncations and garbage are errors, never a panic.
        for n in [0, 5, 110, 115, 120, 130, 200] {
            assert!(read(&out[..n]).is_err(), "{n}");
        }
        let mut bad = out.clone();
        bad[0] = b'1';
        assert!(read(&bad).unwrap_err().contains("no newc header at byte 0"));
    }
}
