//! `csrc/fastmem.c`: the `memcpy` and `memmove` the static (musl) build uses in place of musl's,
//! checked against a byte loop for every size to 1 KiB and a few larger, every source and
//! destination alignment in a 16-byte line, and every overlap in both directions.
//!
//! `unsafe` here, and only here: the functions are C, reached through FFI on raw pointers. Every
//! call stays inside one buffer the test owns, at offsets and lengths it checked fit.
#![cfg(target_arch = "x86_64")]

use std::ffi::c_void;

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

fn copy_checked(n: usize, s_off: usize, d_off: usize) {
    let src = pattern(n + GUARD * 2, 0x5a);
    let mut dst = pattern(n + GUARD * 2, 0xa5);
    let mut want = dst.clone();
    want[GUARD + d_off..GUARD + d_off + n].copy_from_slice(&src[GUARD + s_off..GUARD + s_off + n]);
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

#[test]
fn memmove_copies_every_overlap_in_both_directions() {
    for n in (0..=300).chain([1024, 4096, 4099]) {
        // The destination from 40 bytes before the source to 40 after it (0: the same place).
        for shift in -40i64..=40 {
            let len = n + 2 * GUARD + 80;
            let mut buf = pattern(len, 0x3c);
            let s = GUARD + 40;
            let d = (s as i64 + shift) as usize;
            let mut want = buf.clone();
            want.copy_within(s..s + n, d);
            // SAFETY: s + n and d + n are at most len - GUARD.
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
    }
}
