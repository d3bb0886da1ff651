//! Pools: their policy (which attestors may admit machines, Kubernetes) and the record the API
//! returns.

use crate::base::clock::rfc3339;
use crate::base::error::{ApiError, ApiResult};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

pub const ATTESTORS: &[&str] = &["join-token", "discovery", "tpm", "x509pop"];

#[derive(Deserialize, Serialize, Default, Clone, PartialEq, Debug)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Policy {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_attestors: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<KubernetesPolicy>,
    /// What is checked before a joined node is adopted (none: adopted at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acceptance: Option<crate::domain::acceptance::AcceptancePolicy>,
}

#[derive(Deserialize, Serialize, Default, Clone, PartialEq, Debug)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubernetesPolicy {
    #[serde(default)]
    pub platform_operated: bool,
}

impl Policy {
    pub fn validate(&self) -> ApiResult<()> {
        if let Some(a) = &self.join_attestors {
            if a.is_empty() {
                return Err(ApiError::invalid_input(
                    "policy.joinAttestors must name at least one attestor",
                ));
            }
            for (n, x) in a.iter().enumerate() {
                if !ATTESTORS.contains(&x.as_str()) {
                    return Err(ApiError::invalid_input(format!(
                        "policy.joinAttestors: unknown attestor {x:?}; known: {}",
                        ATTESTORS.join(", ")
                    )));
                }
                if a[..n].contains(x) {
                    return Err(ApiError::invalid_input(format!(
                        "policy.joinAttestors names {x} twice"
                    )));
                }
            }
        }
        if let Some(a) = &self.acceptance {
            a.validate()?;
        }
        Ok(())
    }

    /// The acceptance checks, when the pool runs any.
    pub fn acceptance(&self) -> Option<&crate::domain::acceptance::AcceptancePolicy> {
        self.acceptance.as_ref().filter(|a| a.runs())
    }
}

#[derive(Debug, Clone)]
pub struct Pool {
    pub id: String,
    pub tenant_id: String,
    pub site_id: String,
    pub name: String,
    pub agent: String,
    pub policy: Policy,
    pub archived_at: Option<i64>,
    pub created_at: i64,
    pub updated_at: i64,
}

impl Pool {
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "id": self.id, "tenantId": self.tenant_id, "siteId": self.site_id, "name": self.name,
            "agent": self.agent, "policy": self.policy,
            "createdAt": rfc3339(self.created_at), "updatedAt": rfc3339(self.updated_at),
        });
        if let Some(a) = self.archived_at {
            v["archivedAt"] = json!(rfc3339(a));
        }
        v
    }

    /// Whether the pool's policy lets `attestor` admit machines (no list means every attestor).
    pub fn allows_attestor(&self, attestor: &str) -> bool {
        self.policy
            .join_attestors
            .as_ref()
            .is_none_or(|l| l.iter().any(|a| a == attestor))
    }
}
