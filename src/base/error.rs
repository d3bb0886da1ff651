//! The stable error codes users see, each with a message a person can act on.

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Code {
    InvalidInput,
    NotFound,
    InvalidState,
    Conflict,
    AlreadyExists,
    AccessDenied,
    InvalidConfig,
    /// Busy or stopping: retry later.
    Unavailable,
    Internal,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::InvalidInput => "INVALID_INPUT",
            Code::NotFound => "NOT_FOUND",
            Code::InvalidState => "INVALID_STATE",
            Code::Conflict => "CONFLICT",
            Code::AlreadyExists => "ALREADY_EXISTS",
            Code::AccessDenied => "ACCESS_DENIED",
            Code::InvalidConfig => "INVALID_CONFIG",
            Code::Unavailable => "UNAVAILABLE",
            Code::Internal => "INTERNAL",
        }
    }

    /// The HTTP status the admin API answers with.
    pub fn http_status(self) -> u16 {
        match self {
            Code::InvalidInput => 400,
            Code::AccessDenied => 403,
            Code::NotFound => 404,
            Code::InvalidState | Code::Conflict | Code::AlreadyExists => 409,
            Code::Unavailable => 503,
            Code::InvalidConfig | Code::Internal => 500,
        }
    }
}

/// An error with its stable code; `message` is what the user reads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiError {
    pub code: Code,
    pub message: String,
}

impl ApiError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
    pub fn invalid_input(m: impl Into<String>) -> Self {
        Self::new(Code::InvalidInput, m)
    }
    pub fn not_found(m: impl Into<String>) -> Self {
        Self::new(Code::NotFound, m)
    }
    pub fn unavailable(m: impl Into<String>) -> Self {
        Self::new(Code::Unavailable, m)
    }
    pub fn invalid_state(m: impl Into<String>) -> Self {
        Self::new(Code::InvalidState, m)
    }
    pub fn conflict(m: impl Into<String>) -> Self {
        Self::new(Code::Conflict, m)
    }
    pub fn already_exists(m: impl Into<String>) -> Self {
        Self::new(Code::AlreadyExists, m)
    }
    pub fn access_denied(m: impl Into<String>) -> Self {
        Self::new(Code::AccessDenied, m)
    }
    pub fn invalid_config(m: impl Into<String>) -> Self {
        Self::new(Code::InvalidConfig, m)
    }
    /// An internal failure: the cause is logged here, the user sees a generic message.
    pub fn internal(cause: impl fmt::Display) -> Self {
        tracing::error!(%cause, "internal error");
        Self::new(Code::Internal, "internal error; see the appliance's log")
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

impl std::error::Error for ApiError {}

pub type ApiResult<T> = Result<T, ApiError>;

pub fn code_of(v: &serde_json::Value) -> Option<Code> {
    serde_json::from_value(v.get("code")?.clone()).ok()
}

/// The error body the admin API answers with.
pub fn error_body(e: &ApiError) -> serde_json::Value {
    serde_json::json!({"code": e.code.as_str(), "message": e.message})
}
