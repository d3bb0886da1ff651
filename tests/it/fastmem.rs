//! `csrc/fastmem.c`: the `memcpy` and `memmove` the static (musl) build uses in place of musl's,
//! checked against a byte loop (`black_box` keeps the compiler from making it a `memcpy` call,
//! which would test the code with itself in the static build) for every size to 1 KiB and a few
//! larger, every source and destination alignment in a 16-byte line; `memmove` for every distance
//! between source and destination from -(n+2) to n+2 for every size to 200 (each overlap, the
//! boundary where buffers stop overlapping, and beyond it), at the boundaries for larger sizes,
//! with the source alignment moving with the distance.
//!
//! The test runs the C code under its own names (`bca_memcpy`, `bca_memmove`) in the host build;
//! the static build links the same code as `memcpy` and `memmove` (`build.rs`), which the network
//! boot tests run inside the ramdisk.
//!
//! `unsafe` here, and only here: the functions are C, reached through FFI on raw pointers. Every
//! call stays inside one buffer the test owns, at offsets and lengths it checked fit.
#![cfg(target_arch = "x86_64")]

use std::ffi::c_void;
use std::hint::black_box;

extern "C" {
    fn bca_memcpy(dest: *mut c_void, src: *const c_void, n: usize) -> *mut c_void;
    fn bca_memmove(dest: *mut c_void, src: *const c_void, n: usize) -> *mut c_void;
}

const GUARD: usize = 32;

fn sizes() -> impl Iterator<Item = usize> {
    (0..=1024).chain([1500, 4095, 4096, 4097, 65_536 + 7])
}

/// A buffer of distinct-ish bytes, so a byte from the wrong place shows.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed)
        .collect()
}

/// The reference: `buf[d..d + n] = buf[s..s + n]` one byte at a time, through a copy (so an
/// overlap is copied as memmove does).
fn byte_move(buf: &mut [u8], s: usize, d: usize, n: usize) {
    let mut tmp = Vec::with_capacity(n);
    for i in 0..n {
        tmp.push(black_box(buf[s + i]));
    }
    for (i, b) in tmp.into_iter().enumerate() {
        buf[d + i] = black_box(b);
    }
}

fn copy_checked(n: usize, s_off: usize, d_off: usize) {
    let src = pattern(n + GUARD * 2, 0x5a);
    let mut dst = pattern(n + GUARD * 2, 0xa5);
    let mut want = dst.clone();
    for i in 0..n {
        want[GUARD + d_off + i] = black_box(src[GUARD + s_off + i]);
    }
    // SAFETY: both ranges lie inside their buffers (n + 2 * GUARD long, offsets below GUARD).
    let r = unsafe {
        bca_memcpy(
            dst.as_mut_ptr().add(GUARD + d_off).cast(),
            src.as_ptr().add(GUARD + s_off).cast(),
            n,
        )
    };
    assert_eq!(r as usize, dst.as_ptr() as usize + GUARD + d_off);
    assert!(
        dst == want,
        "memcpy of {n} bytes, source +{s_off}, destination +{d_off}"
    );
}

#[test]
fn memcpy_copies_every_size_and_alignment_and_nothing_around_it() {
    for n in sizes() {
        for s_off in 0..16 {
            for d_off in 0..16 {
                copy_checked(n, s_off, d_off);
            }
        }
    }
}

fn move_checked(n: usize, shift: i64) {
    // The source in the middle third, its alignment moving with the distance.
    let align = (n as i64 + shift).rem_euclid(16) as usize;
    let len = 3 * (n + 2) + 2 * GUARD + 16;
    let mut buf = pattern(len, 0x3c);
    let s = GUARD + (n + 2) + align;
    let d = (s as i64 + shift) as usize;
    let mut want = buf.clone();
    byte_move(&mut want, s, d, n);
    // SAFETY: s + n and d + n are at most len - GUARD (|shift| <= n + 2).
    let r = unsafe {
        bca_memmove(
            buf.as_mut_ptr().add(d).cast(),
            buf.as_ptr().add(s).cast(),
            n,
        )
    };
    assert_eq!(r as usize, buf.as_ptr() as usize + d);
    assert!(
        buf == want,
        "memmove of {n} bytes, destination {shift:+} from the source"
    );
}

#[test]
fn memmove_copies_every_overlap_in_both_directions() {
    for n in 0..=200usize {
        let reach = n as i64 + 2;
        for shift in -reach..=reach {
            move_checked(n, shift);
        }
    }
    for n in [255usize, 256, 1024, 4099] {
        let n_i = n as i64;
        for d in [
            0,
            1,
            15,
            16,
            17,
            40,
            n_i / 2,
            n_i - 17,
            n_i - 16,
            n_i - 1,
            n_i,
            n_i + 1,
            n_i + 2,
        ] {
            move_checked(n, d);
            move_checked(n, -d);
        }
    }
}
