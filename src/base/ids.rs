//! Identifiers the user sees: `<prefix>_` followed by 26 lowercase Crockford base32 characters.
//!
//! Ids minted by the appliance carry a 48-bit millisecond timestamp first (like a ULID), so that
//! listing in id order is listing in creation order. Join-token ids are derived instead (see
//! [`derived_id`]), as the API reference requires.

use aws_lc_rs::digest;

/// Crockford's base32 alphabet, lower case, without `i`, `l`, `o`, `u`.
const ALPHABET: &[u8; 32] = b"0123456789abcdefghjkmnpqrstvwxyz";

/// Encodes 128 bits as exactly 26 base32 characters (the first carries the top 3 bits).
pub fn encode_u128(v: u128) -> String {
    let mut out = String::with_capacity(26);
    for i in 0..26u32 {
        let shift = 125 - 5 * i;
        out.push(ALPHABET[((v >> shift) & 31) as usize] as char);
    }
    out
}

/// A fresh, time-ordered id with the given prefix (`node`, `pool`, ...).
pub fn new_id(prefix: &str, now_ms: i64) -> String {
    let mut rnd = [0u8; 10];
    crate::base::crypto::fill_random(&mut rnd);
    let mut v: u128 = (now_ms.max(0) as u128 & ((1u128 << 48) - 1)) << 80;
    for (i, b) in rnd.iter().enumerate() {
        v |= (*b as u128) << (8 * (9 - i));
    }
    format!("{prefix}_{}", encode_u128(v))
}

/// An id derived from the given parts (length-prefixed, so no two part lists collide).
pub fn derived_id(prefix: &str, domain: &str, parts: &[&str]) -> String {
    let mut ctx = digest::Context::new(&digest::SHA256);
    ctx.update(domain.as_bytes());
    for p in parts {
        ctx.update(&(p.len() as u64).to_be_bytes());
        ctx.update(p.as_bytes());
    }
    let d = ctx.finish();
    let mut b = [0u8; 16];
    b.copy_from_slice(&d.as_ref()[..16]);
    format!("{prefix}_{}", encode_u128(u128::from_be_bytes(b)))
}

/// True when `s` is `<prefix>_` followed by 26 to `max` characters of the alphabet.
pub fn is_id(s: &str, prefix: &str, max: usize) -> bool {
    let Some(rest) = s.strip_prefix(prefix).and_then(|r| r.strip_prefix('_')) else {
        return false;
    };
    (26..=max).contains(&rest.len()) && rest.bytes().all(|c| ALPHABET.contains(&c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_have_the_documented_shape() {
        let id = new_id("node", 1_700_000_000_000);
        assert!(is_id(&id, "node", 26), "{id}");
        assert_eq!(id.len(), "node_".len() + 26);
        let j = derived_id("jt", "bca-join-token-id", &["tn_x", "uid:0", "key"]);
        assert!(is_id(&j, "jt", 52));
        assert_eq!(
            j,
            derived_id("jt", "bca-join-token-id", &["tn_x", "uid:0", "key"])
        );
        assert_ne!(
            j,
            derived_id("jt", "bca-join-token-id", &["tn_x", "uid:0k", "ey"])
        );
    }

    #[test]
    fn ids_sort_by_time() {
        let a = new_id("pool", 1_000);
        let b = new_id("pool", 2_000);
        assert!(a < b);
    }

    #[test]
    fn is_id_refuses_bad_values() {
        assert!(!is_id("jt_", "jt", 52));
        assert!(!is_id("jt_0123456789abcdefghjkmnpqri", "jt", 52)); // 'i' is not in the alphabet
        assert!(!is_id("jx_0123456789abcdefghjkmnpqrs", "jt", 52));
        assert!(is_id("jt_0123456789abcdefghjkmnpqrs", "jt", 52));
        assert!(!is_id("JT_0123456789ABCDEFGHJKMNPQRS", "jt", 52));
    }
}
