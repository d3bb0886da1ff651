//! Acceptance: what a pool checks before a node that joined (`adopting`) is `adopted`. The seed:
//! a pool without acceptance checks adopts at once; with them the node stays `adopting`, its
//! first `Hello` starts acceptance, and a failure leaves an `AcceptanceFailed` condition that
//! `nodes.adopt` retries after a fix. This module is the rule, a pure function of the pool's
//! policy and what the appliance knows of the node.

use crate::base::error::{ApiError, ApiResult};
use serde::{Deserialize, Serialize};

/// The checks a pool may name.
pub const CHECKS: &[&str] = &["session", "clock", "claims", "macs", "tpm"];

/// `policy.acceptance` of a pool.
#[derive(Deserialize, Serialize, Clone, PartialEq, Debug)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AcceptancePolicy {
    #[serde(default)]
    pub checks: Vec<String>,
    /// For `clock`: how far the agent's signed clock may be from the appliance's.
    #[serde(default = "default_skew")]
    pub max_clock_skew_seconds: u32,
    /// For `macs`: permanent MACs the node must have reported.
    #[serde(default = "one")]
    pub min_macs: u32,
    /// The same as naming `tpm`.
    #[serde(default)]
    pub require_tpm: bool,
}

fn default_skew() -> u32 {
    30
}
fn one() -> u32 {
    1
}

impl AcceptancePolicy {
    pub fn validate(&self) -> ApiResult<()> {
        for (n, c) in self.checks.iter().enumerate() {
            if !CHECKS.contains(&c.as_str()) {
                return Err(ApiError::invalid_input(format!(
                    "policy.acceptance.checks: unknown check {c:?}; known: {}",
                    CHECKS.join(", ")
                )));
            }
            if self.checks[..n].contains(c) {
                return Err(ApiError::invalid_input(format!(
                    "policy.acceptance.checks names {c} twice"
                )));
            }
        }
        if !(1..=3600).contains(&self.max_clock_skew_seconds) {
            return Err(ApiError::invalid_input(
                "policy.acceptance.maxClockSkewSeconds must be 1 to 3600",
            ));
        }
        if !(1..=64).contains(&self.min_macs) {
            return Err(ApiError::invalid_input(
                "policy.acceptance.minMacs must be 1 to 64",
            ));
        }
        Ok(())
    }

    /// The checks in the order they run (`requireTpm` adds `tpm` when not named).
    pub fn effective(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.checks.iter().map(String::as_str).collect();
        if self.require_tpm && !v.contains(&"tpm") {
            v.push("tpm");
        }
        v
    }

    /// Whether there is anything to check (no checks: adopted at once).
    pub fn runs(&self) -> bool {
        !self.effective().is_empty()
    }
}

/// What the node's last signed `Hello` showed, kept for `nodes.adopt`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HelloFacts {
    /// The agent's clock minus the appliance's, in seconds.
    pub skew: i64,
    /// The claims it reported name the identifiers it joined with.
    pub claims_match: bool,
}

/// What the appliance knows of the node when it checks.
pub struct Evidence {
    /// The node has a live session.
    pub session: bool,
    /// Its last `Hello` carried evidence signed by its node key.
    pub hello: Option<HelloFacts>,
    /// Permanent MACs among the identifiers it joined with.
    pub permanent_macs: usize,
    /// Its certificate names a TPM AK: the node key is held by a TPM.
    pub tpm_key: bool,
}

/// A failed check: its name (the condition's `reason`) and what an operator reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub check: &'static str,
    pub message: String,
}

/// Runs the policy's checks in order; the first that fails is the answer.
pub fn check(p: &AcceptancePolicy, e: &Evidence) -> Result<(), Failure> {
    for c in p.effective() {
        let fail = |check: &'static str, message: String| Err(Failure { check, message });
        match c {
            "session" if !e.session => {
                return fail("session", "the node has no session with the gateway".into())
            }
            "clock" => match &e.hello {
                None => {
                    return fail(
                        "clock",
                        "the agent sent no signed clock in its Hello (an agent older than this check?)"
                            .into(),
                    )
                }
                Some(h) if h.skew.unsigned_abs() > p.max_clock_skew_seconds as u64 => {
                    return fail(
                        "clock",
                        format!(
                            "the agent's clock is {} s off the appliance's; the pool allows {} s: fix NTP on the machine",
                            h.skew, p.max_clock_skew_seconds
                        ),
                    )
                }
                _ => {}
            },
            "claims" => match &e.hello {
                None => return fail("claims", "the agent sent no signed claims in its Hello".into()),
                Some(h) if !h.claims_match => {
                    return fail(
                        "claims",
                        "the claims the agent reported in its Hello differ from those it joined with"
                            .into(),
                    )
                }
                _ => {}
            },
            "macs" if e.permanent_macs < p.min_macs as usize => {
                return fail(
                    "macs",
                    format!(
                        "the node reported {} permanent MACs; the pool requires {}",
                        e.permanent_macs, p.min_macs
                    ),
                )
            }
            "tpm" if !e.tpm_key => {
                return fail(
                    "tpm",
                    "the node key is not held by a TPM (nodeKey: unattested); join with --attestor tpm"
                        .into(),
                )
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(checks: &[&str]) -> AcceptancePolicy {
        AcceptancePolicy {
            checks: checks.iter().map(|s| s.to_string()).collect(),
            max_clock_skew_seconds: 30,
            min_macs: 2,
            require_tpm: false,
        }
    }

    fn good() -> Evidence {
        Evidence {
            session: true,
            hello: Some(HelloFacts {
                skew: -30,
                claims_match: true,
            }),
            permanent_macs: 2,
            tpm_key: true,
        }
    }

    #[test]
    fn each_check_fails_alone_and_the_first_failure_is_the_answer() {
        let all = policy(&["session", "clock", "claims", "macs", "tpm"]);
        assert_eq!(check(&all, &good()), Ok(()));
        let reason = |f: &dyn Fn(&mut Evidence)| {
            let mut e = good();
            f(&mut e);
            check(&all, &e).unwrap_err().check
        };
        assert_eq!(reason(&|e| e.session = false), "session");
        assert_eq!(reason(&|e| e.hello.as_mut().unwrap().skew = 31), "clock");
        assert_eq!(reason(&|e| e.hello = None), "clock");
        assert_eq!(
            reason(&|e| e.hello.as_mut().unwrap().claims_match = false),
            "claims"
        );
        assert_eq!(reason(&|e| e.permanent_macs = 1), "macs");
        assert_eq!(reason(&|e| e.tpm_key = false), "tpm");
        // Only what the pool names is checked; requireTpm adds `tpm`.
        let mut e = good();
        e.tpm_key = false;
        e.session = false;
        assert_eq!(check(&policy(&["macs"]), &e), Ok(()));
        let mut p = policy(&["macs"]);
        p.require_tpm = true;
        assert_eq!(check(&p, &e).unwrap_err().check, "tpm");
        assert!(!policy(&[]).runs());
    }

    #[test]
    fn a_policy_names_known_checks_once_within_its_bounds() {
        assert!(policy(&["session", "clock"]).validate().is_ok());
        let e = policy(&["sessions"]).validate().unwrap_err();
        assert!(
            e.message.contains("unknown check \"sessions\""),
            "{}",
            e.message
        );
        assert!(policy(&["clock", "clock"]).validate().is_err());
        let mut p = policy(&["clock"]);
        p.max_clock_skew_seconds = 0;
        assert!(p.validate().is_err());
        p.max_clock_skew_seconds = 30;
        p.min_macs = 65;
        assert!(p.validate().is_err());
    }
}
