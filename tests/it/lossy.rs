//! A disk that loses what was not flushed, as a power cut does: an NBD server (the newstyle
//! protocol, simple replies) over a raw image file, which QEMU's NBD client attaches as the VM's
//! virtio disk with a volatile write cache.
//!
//! Every write lands in memory, per 512-byte sector; `NBD_CMD_FLUSH` (the guest's cache flush:
//! fsync, a journal commit) writes them to the image and fsyncs it; a write with `FUA` is written
//! through at once. When the connection drops without a clean `NBD_CMD_DISC` (QEMU killed: the
//! power cut), the unflushed sectors are thrown away, or (every other cut) a random subset of
//! them is kept, in no order, as a drive's volatile cache may have written some of them before
//! the power went. So the cut is harsher than `cache=none` on the host, which keeps every write
//! the guest submitted, flushed or not (the host's kernel completes it after QEMU dies).
//!
//! The guest flushes often (SQLite's `synchronous=FULL`, ext4's journal), so a cut at a random
//! moment mostly finds the cache empty. [`LossyDisk::arm`] makes the cut sharp: the next flush
//! the guest asks for while writes are pending is never answered, and the test cuts the power
//! then, with those writes written and not yet durable (an fsync in flight, a commit waiting).

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

const SECTOR: u64 = 512;
const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = 0x8000_0001;
const FLAG_HAS_FLAGS: u16 = 1;
const FLAG_SEND_FLUSH: u16 = 4;
const FLAG_SEND_FUA: u16 = 8;
const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_FLAG_FUA: u16 = 1;
const EINVAL: u32 = 22;

/// What one power cut did to the disk's volatile cache.
#[derive(Debug, Default, Clone, Copy)]
pub struct Cut {
    /// Sectors written since the last flush when the power went.
    pub unflushed: usize,
    /// Of those, the sectors the "drive" had written anyway (the rest are lost).
    pub kept: usize,
    /// Flushes the guest asked for while it ran.
    pub flushes: usize,
}

/// A lossy disk serving one VM boot: the socket QEMU attaches to and the thread that serves it.
pub struct LossyDisk {
    pub socket: PathBuf,
    server: std::thread::JoinHandle<Cut>,
    armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    held: std::sync::mpsc::Receiver<()>,
}

impl LossyDisk {
    /// Serves `image` on a new socket in `dir`, for one connection. Every other cut keeps a
    /// random subset of the unflushed sectors (`cut_number` odd), the others keep none.
    pub fn serve(image: &Path, dir: &Path, cut_number: usize) -> LossyDisk {
        let socket = dir.join(format!("nbd-{}.sock", crate::common::rand_hex(4)));
        let listener = UnixListener::bind(&socket).unwrap();
        let image = image.to_path_buf();
        let armed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (tx, held) = std::sync::mpsc::channel();
        let server = {
            let armed = armed.clone();
            std::thread::spawn(move || {
                let (conn, _) = listener.accept().unwrap();
                serve_one(conn, &image, cut_number % 2 == 1, &armed, tx)
            })
        };
        LossyDisk {
            socket,
            server,
            armed,
            held,
        }
    }

    /// Holds the next flush the guest asks for while writes are pending, and waits (at most
    /// `timeout`) until one is held: `true` when the power can now be cut with writes in the
    /// cache that the guest is waiting to see made durable.
    pub fn arm(&self, timeout: std::time::Duration) -> bool {
        self.armed.store(true, std::sync::atomic::Ordering::SeqCst);
        self.held.recv_timeout(timeout).is_ok()
    }

    /// QEMU's `-drive` for this disk: virtio, with a write cache the guest must flush.
    pub fn drive(&self) -> String {
        format!(
            "driver=raw,file.driver=nbd,file.server.type=unix,file.server.path={},if=virtio,cache=writeback",
            self.socket.display()
        )
    }

    /// After QEMU is gone: what the cut did (the image now holds only what survived it).
    pub fn cut(self) -> Cut {
        let c = self.server.join().unwrap();
        let _ = std::fs::remove_file(&self.socket);
        c
    }
}

fn read_u16(s: &mut impl Read) -> std::io::Result<u16> {
    let mut b = [0; 2];
    s.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}
fn read_u32(s: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}
fn read_u64(s: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

fn opt_reply(s: &mut UnixStream, opt: u32, kind: u32, data: &[u8]) -> std::io::Result<()> {
    let mut m = Vec::with_capacity(20 + data.len());
    m.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    m.extend_from_slice(&opt.to_be_bytes());
    m.extend_from_slice(&kind.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    s.write_all(&m)
}

/// The disk: the image on the host, and the sectors written since the last flush.
struct Disk {
    file: std::fs::File,
    size: u64,
    dirty: BTreeMap<u64, Vec<u8>>,
    flushes: usize,
}

impl Disk {
    fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        self.file.read_exact_at(&mut out, offset).unwrap();
        let (first, last) = (offset / SECTOR, (offset + len as u64).div_ceil(SECTOR));
        for (&sector, data) in self.dirty.range(first..last) {
            let start = sector * SECTOR;
            for (i, b) in data.iter().enumerate() {
                let at = start + i as u64;
                if at >= offset && at < offset + len as u64 {
                    out[(at - offset) as usize] = *b;
                }
            }
        }
        out
    }

    fn write(&mut self, offset: u64, data: &[u8], through: bool) {
        let (first, last) = (
            offset / SECTOR,
            (offset + data.len() as u64).div_ceil(SECTOR),
        );
        for sector in first..last {
            let start = sector * SECTOR;
            let mut buf = self.read(start, SECTOR as usize);
            for (i, b) in buf.iter_mut().enumerate() {
                let at = start + i as u64;
                if at >= offset && at < offset + data.len() as u64 {
                    *b = data[(at - offset) as usize];
                }
            }
            if through {
                self.dirty.remove(&sector);
                self.file.write_all_at(&buf, start).unwrap();
            } else {
                self.dirty.insert(sector, buf);
            }
        }
        if through {
            self.file.sync_data().unwrap();
        }
    }

    fn flush(&mut self) {
        for (sector, data) in std::mem::take(&mut self.dirty) {
            self.file.write_all_at(&data, sector * SECTOR).unwrap();
        }
        self.file.sync_data().unwrap();
        self.flushes += 1;
    }

    /// The power goes: the volatile cache is lost, but for the sectors kept (a random subset
    /// when `keep_some`).
    fn power_cut(&mut self, keep_some: bool) -> Cut {
        let dirty = std::mem::take(&mut self.dirty);
        let mut kept = 0;
        if keep_some {
            for (sector, data) in &dirty {
                let mut r = [0u8; 1];
                bca::base::crypto::fill_random(&mut r);
                if r[0] & 1 == 1 {
                    self.file.write_all_at(data, sector * SECTOR).unwrap();
                    kept += 1;
                }
            }
        }
        self.file.sync_data().unwrap();
        Cut {
            unflushed: dirty.len(),
            kept,
            flushes: self.flushes,
        }
    }
}

/// The handshake, then requests until the connection ends.
fn serve_one(
    mut s: UnixStream,
    image: &Path,
    keep_some: bool,
    armed: &std::sync::atomic::AtomicBool,
    held: std::sync::mpsc::Sender<()>,
) -> Cut {
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(image)
        .unwrap();
    let size = file.seek(SeekFrom::End(0)).unwrap();
    let mut disk = Disk {
        file,
        size,
        dirty: BTreeMap::new(),
        flushes: 0,
    };
    let flags = FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA;
    if handshake(&mut s, size, flags).is_err() {
        return disk.power_cut(false);
    }
    match transmission(&mut s, &mut disk, armed, &held) {
        // A clean disconnect: the guest flushed before it (QEMU flushes on close).
        Ok(()) => {
            disk.flush();
            Cut {
                flushes: disk.flushes,
                ..Default::default()
            }
        }
        Err(_) => disk.power_cut(keep_some),
    }
}

fn handshake(s: &mut UnixStream, size: u64, flags: u16) -> std::io::Result<()> {
    let mut hello = Vec::new();
    hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    // Fixed newstyle, no zeroes.
    hello.extend_from_slice(&3u16.to_be_bytes());
    s.write_all(&hello)?;
    let client_flags = read_u32(s)?;
    let no_zeroes = client_flags & 2 != 0;
    loop {
        if read_u64(s)? != IHAVEOPT {
            return Err(std::io::ErrorKind::InvalidData.into());
        }
        let opt = read_u32(s)?;
        let len = read_u32(s)? as usize;
        let mut data = vec![0; len];
        s.read_exact(&mut data)?;
        match opt {
            OPT_EXPORT_NAME => {
                let mut m = Vec::new();
                m.extend_from_slice(&size.to_be_bytes());
                m.extend_from_slice(&flags.to_be_bytes());
                if !no_zeroes {
                    m.extend_from_slice(&[0; 124]);
                }
                return s.write_all(&m);
            }
            OPT_INFO | OPT_GO => {
                let mut info = Vec::new();
                info.extend_from_slice(&0u16.to_be_bytes());
                info.extend_from_slice(&size.to_be_bytes());
                info.extend_from_slice(&flags.to_be_bytes());
                opt_reply(s, opt, REP_INFO, &info)?;
                opt_reply(s, opt, REP_ACK, &[])?;
                if opt == OPT_GO {
                    return Ok(());
                }
            }
            OPT_ABORT => {
                opt_reply(s, opt, REP_ACK, &[])?;
                return Err(std::io::ErrorKind::ConnectionAborted.into());
            }
            // Structured replies, metadata contexts, extended headers, TLS: not offered.
            _ => opt_reply(s, opt, REP_ERR_UNSUP, &[])?,
        }
    }
}

fn reply(s: &mut UnixStream, error: u32, cookie: u64, data: &[u8]) -> std::io::Result<()> {
    let mut m = Vec::with_capacity(16 + data.len());
    m.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    m.extend_from_slice(&error.to_be_bytes());
    m.extend_from_slice(&cookie.to_be_bytes());
    m.extend_from_slice(data);
    s.write_all(&m)
}

/// `Ok` on a clean `NBD_CMD_DISC`; an error when the connection drops (the power cut).
fn transmission(
    s: &mut UnixStream,
    disk: &mut Disk,
    armed: &std::sync::atomic::AtomicBool,
    held: &std::sync::mpsc::Sender<()>,
) -> std::io::Result<()> {
    loop {
        if read_u32(s)? != REQUEST_MAGIC {
            return Err(std::io::ErrorKind::InvalidData.into());
        }
        let flags = read_u16(s)?;
        let cmd = read_u16(s)?;
        let cookie = read_u64(s)?;
        let offset = read_u64(s)?;
        let len = read_u32(s)? as usize;
        let in_range = offset
            .checked_add(len as u64)
            .is_some_and(|end| end <= disk.size);
        match cmd {
            CMD_READ if in_range => {
                let data = disk.read(offset, len);
                reply(s, 0, cookie, &data)?;
            }
            CMD_WRITE => {
                let mut data = vec![0; len];
                s.read_exact(&mut data)?;
                if in_range {
                    disk.write(offset, &data, flags & CMD_FLAG_FUA != 0);
                    reply(s, 0, cookie, &[])?;
                } else {
                    reply(s, EINVAL, cookie, &[])?;
                }
            }
            CMD_FLUSH
                if armed.load(std::sync::atomic::Ordering::SeqCst) && !disk.dirty.is_empty() =>
            {
                // Held: never answered, nothing more written; the power goes now.
                let _ = held.send(());
                let mut sink = [0u8; 65536];
                while s.read(&mut sink)? > 0 {}
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            CMD_FLUSH => {
                disk.flush();
                reply(s, 0, cookie, &[])?;
            }
            CMD_DISC => return Ok(()),
            _ => reply(s, EINVAL, cookie, &[])?,
        }
    }
}

/// QEMU's own NBD client (`qemu-io`) against the lossy disk: what it read back is what it wrote,
/// a flushed write survives the cut, an unflushed one is gone, and a clean close keeps all.
#[test]
fn qemu_sees_a_disk_that_loses_only_what_was_not_flushed() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let qemu_io = |disk: &LossyDisk, cmds: &[&str]| {
        // Unbuffered: `abort` (the power cut) must not take qemu-io's output with it.
        let mut c = std::process::Command::new("stdbuf");
        c.args(["-o0", "qemu-io", "-t", "writeback", "-f", "raw"])
            .arg(format!("nbd+unix:///?socket={}", disk.socket.display()));
        for cmd in cmds {
            c.args(["-c", cmd]);
        }
        c.output().unwrap()
    };
    let at = |offset: usize| std::fs::read(&img).unwrap()[offset];

    // The power goes (qemu-io aborts) after a flushed write and an unflushed one.
    let disk = LossyDisk::serve(&img, dir.path(), 0);
    let o = qemu_io(
        &disk,
        &[
            "write -P 0xcd 65536 4k",
            "flush",
            "write -P 0xab 0 4k",
            "read -P 0xab 0 4k",
            "abort",
        ],
    );
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(
        said.contains("read 4096/4096 bytes") && !said.contains("verification failed"),
        "{said}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let cut = disk.cut();
    assert_eq!((cut.unflushed, cut.kept, cut.flushes), (8, 0, 1), "{cut:?}");
    assert_eq!(at(65536), 0xcd, "the flushed write was lost");
    assert_eq!(at(0), 0, "the unflushed write survived the cut");

    // An unaligned write merges with what the sector held.
    let disk = LossyDisk::serve(&img, dir.path(), 0);
    let o = qemu_io(
        &disk,
        &[
            "write -P 0x11 65600 10",
            "read -P 0xcd 65536 64",
            "read -P 0x11 65600 10",
            "abort",
        ],
    );
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(
        said.matches("bytes at offset").count() == 3 && !said.contains("verification failed"),
        "{said}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    disk.cut();
    assert_eq!(at(65600), 0xcd);

    // A clean close flushes: everything written stays.
    let disk = LossyDisk::serve(&img, dir.path(), 0);
    let o = qemu_io(&disk, &["write -P 0xef 4096 4k"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cut = disk.cut();
    assert_eq!(cut.unflushed, 0, "{cut:?}");
    assert_eq!(at(4096), 0xef);
}
