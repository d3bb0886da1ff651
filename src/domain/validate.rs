//! The API reference's input constraints, as small checks that name the field and the rule.

use crate::base::error::{ApiError, ApiResult};

fn matches(
    s: &str,
    min: usize,
    max: usize,
    first: impl Fn(u8) -> bool,
    rest: impl Fn(u8) -> bool,
) -> bool {
    let b = s.as_bytes();
    (min..=max).contains(&b.len())
        && b.first().is_none_or(|c| first(*c))
        && b.iter().skip(1).all(|c| rest(*c))
}

fn alnum(c: u8) -> bool {
    c.is_ascii_alphanumeric()
}

fn fail(field: &str, pattern: &str, max: usize) -> ApiError {
    ApiError::invalid_input(format!(
        "{field} must be at most {max} characters and match {pattern}"
    ))
}

/// `^[A-Za-z0-9._:-]{1,128}$`
pub fn tenant_id(field: &str, s: &str) -> ApiResult<()> {
    let ok = |c: u8| alnum(c) || b"._:-".contains(&c);
    if matches(s, 1, 128, ok, ok) {
        Ok(())
    } else {
        Err(fail(field, "^[A-Za-z0-9._:-]{1,128}$", 128))
    }
}

/// `^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$`
pub fn pool_id(field: &str, s: &str) -> ApiResult<()> {
    if matches(s, 1, 128, alnum, |c| alnum(c) || b"._:-".contains(&c)) {
        Ok(())
    } else {
        Err(fail(field, "^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$", 128))
    }
}

/// `^[A-Za-z0-9._~:/+=-]{1,128}$`
pub fn idempotency_key(field: &str, s: &str) -> ApiResult<()> {
    let ok = |c: u8| alnum(c) || b"._~:/+=-".contains(&c);
    if matches(s, 1, 128, ok, ok) {
        Ok(())
    } else {
        Err(fail(field, "^[A-Za-z0-9._~:/+=-]{1,128}$", 128))
    }
}

/// `^[0-9A-Fa-f-]{8,64}$`
pub fn product_uuid(field: &str, s: &str) -> ApiResult<()> {
    let ok = |c: u8| c.is_ascii_hexdigit() || c == b'-';
    if matches(s, 8, 64, ok, ok) {
        Ok(())
    } else {
        Err(fail(field, "^[0-9A-Fa-f-]{8,64}$", 64))
    }
}

/// `^[A-Za-z0-9._:/+-]{1,128}$`
pub fn serial(field: &str, s: &str) -> ApiResult<()> {
    let ok = |c: u8| alnum(c) || b"._:/+-".contains(&c);
    if matches(s, 1, 128, ok, ok) {
        Ok(())
    } else {
        Err(fail(field, "^[A-Za-z0-9._:/+-]{1,128}$", 128))
    }
}

/// `^[0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2}){5}$`
pub fn mac(field: &str, s: &str) -> ApiResult<()> {
    let b = s.as_bytes();
    let ok = b.len() == 17
        && b.iter().enumerate().all(|(i, c)| {
            if i % 3 == 2 {
                *c == b':'
            } else {
                c.is_ascii_hexdigit()
            }
        });
    if ok {
        Ok(())
    } else {
        Err(fail(field, "^[0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2}){5}$", 17))
    }
}

/// `^GPU-[0-9A-Fa-f-]{8,64}$`
pub fn gpu_uuid(field: &str, s: &str) -> ApiResult<()> {
    let ok = |c: u8| c.is_ascii_hexdigit() || c == b'-';
    match s.strip_prefix("GPU-") {
        Some(rest) if matches(rest, 8, 64, ok, ok) => Ok(()),
        _ => Err(fail(field, "^GPU-[0-9A-Fa-f-]{8,64}$", 68)),
    }
}

/// `^<prefix>_[0-9a-hjkmnp-tv-z]{26,52}$`, at most 64 characters.
pub fn id(field: &str, s: &str, prefix: &str) -> ApiResult<()> {
    if s.len() <= 64 && crate::base::ids::is_id(s, prefix, 52) {
        Ok(())
    } else {
        Err(fail(
            field,
            &format!("^{prefix}_[0-9a-hjkmnp-tv-z]{{26,52}}$"),
            64,
        ))
    }
}

/// A name for a tenant or pool: `^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`.
pub fn name(field: &str, s: &str) -> ApiResult<()> {
    if matches(s, 1, 63, alnum, |c| alnum(c) || b"._-".contains(&c)) {
        Ok(())
    } else {
        Err(fail(field, "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$", 63))
    }
}

/// A filter prefix (an event type, an audit action): `min` to 128 characters of [A-Za-z0-9._-].
pub fn prefix(field: &str, v: &str, min: usize) -> ApiResult<()> {
    let ok = (min..=128).contains(&v.len())
        && v.bytes()
            .all(|c| c.is_ascii_alphanumeric() || b".-_".contains(&c));
    if ok {
        return Ok(());
    }
    let len = if min == 0 {
        "at most 128".to_string()
    } else {
        format!("{min} to 128")
    };
    Err(ApiError::invalid_input(format!(
        "{field} must be {len} characters of [A-Za-z0-9._-]"
    )))
}

pub fn range(field: &str, v: i64, min: i64, max: i64) -> ApiResult<()> {
    if (min..=max).contains(&v) {
        Ok(())
    } else {
        Err(ApiError::invalid_input(format!(
            "{field} must be from {min} to {max}, got {v}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        assert!(tenant_id("t", "tn_abc:x-y.z").is_ok());
        assert!(tenant_id("t", "").is_err());
        assert!(tenant_id("t", &"a".repeat(129)).is_err());
        assert!(tenant_id("t", "a b").is_err());
        assert!(pool_id("p", "-x").is_err());
        assert!(pool_id("p", "x-").is_ok());
        assert!(mac("m", "aa:bb:cc:dd:ee:ff").is_ok());
        assert!(mac("m", "aa-bb-cc-dd-ee-ff").is_err());
        assert!(mac("m", "aa:bb:cc:dd:ee:f").is_err());
        assert!(gpu_uuid("g", "GPU-12345678").is_ok());
        assert!(gpu_uuid("g", "gpu-12345678").is_err());
        assert!(gpu_uuid("g", "GPU-1234567").is_err());
        assert!(product_uuid("u", "1234567").is_err());
        assert!(product_uuid("u", "12345678-abcd").is_ok());
        assert!(serial("s", "SN-7701/a+b").is_ok());
        assert!(serial("s", "SN 7701").is_err());
        assert!(idempotency_key("k", "adopt-rack-b7-u12").is_ok());
        assert!(idempotency_key("k", "a?b").is_err());
        let e = pool_id("poolId", "").unwrap_err();
        assert!(e.message.contains("poolId"), "{e}");
    }
}
