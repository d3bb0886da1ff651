//! Durations given on the command line (`--ttl 2h`): read by the commands of several files,
//! beside the argument definitions rather than in them.

/// Parses `1m` .. `24h` style durations (`h`, `m`, `s` parts, e.g. `1h30m`) to whole seconds.
pub fn parse_duration(s: &str) -> Result<i64, String> {
    let bad = || format!("--ttl {s:?} is not a duration such as 30m, 1h or 1h30m");
    if s.is_empty() {
        return Err(bad());
    }
    let mut total: i64 = 0;
    let mut num = String::new();
    let mut units = 0;
    for c in s.chars() {
        if c.is_ascii_digit() {
            num.push(c);
            if num.len() > 6 {
                return Err(bad());
            }
        } else {
            let mult = match c {
                'h' => 3600,
                'm' => 60,
                's' => 1,
                _ => return Err(bad()),
            };
            let n: i64 = num.parse().map_err(|_| bad())?;
            total += n * mult;
            num.clear();
            units += 1;
        }
    }
    if !num.is_empty() || units == 0 {
        return Err(bad());
    }
    if !(60..=86_400).contains(&total) {
        return Err(format!("--ttl {s} is {total} s; it must be from 1m to 24h"));
    }
    Ok(total)
}
