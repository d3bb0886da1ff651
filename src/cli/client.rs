//! The CLI's client of the admin API: HTTP/1.1 over the Unix socket, one request a connection.

use crate::base::error::{ApiError, Code};
use crate::base::net::split_response;
use serde_json::Value;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub struct Client {
    pub socket: PathBuf,
}

impl Client {
    pub fn new(socket: &Path) -> Self {
        Self {
            socket: socket.to_path_buf(),
        }
    }

    /// Calls `<group>/<method>` with a JSON body; an error answer becomes its `ApiError`.
    pub fn call(&self, method: &str, body: &Value) -> Result<Value, ApiError> {
        let mut s = UnixStream::connect(&self.socket).map_err(|e| {
            ApiError::new(
                Code::InvalidState,
                format!(
                    "cannot reach the appliance at {}: {e} (is bca serve running? use --socket, BCA_SOCKET or --state-dir)",
                    self.socket.display()
                ),
            )
        })?;
        let _ = s.set_read_timeout(Some(Duration::from_secs(120)));
        let payload = serde_json::to_vec(body).expect("serializes");
        let head = format!(
            "POST {}/{method} HTTP/1.1\r\nhost: bca\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            crate::proto::protocol::BASE_PATH,
            payload.len()
        );
        let io = |e: std::io::Error| {
            ApiError::new(
                Code::Internal,
                format!("talking to the appliance failed: {e}"),
            )
        };
        // The appliance may answer (and close) before reading the body, e.g. when it refuses
        // the caller: read its answer even when writing failed.
        let wrote = s
            .write_all(head.as_bytes())
            .and_then(|_| s.write_all(&payload));
        let mut raw = Vec::new();
        let read = s.read_to_end(&mut raw);
        if raw.is_empty() {
            wrote.map_err(io)?;
            read.map_err(io)?;
        }
        let (status, body) = split_response(&raw).ok_or_else(|| {
            ApiError::new(Code::Internal, "the appliance sent a malformed answer")
        })?;
        let v: Value = serde_json::from_slice(body).map_err(|e| {
            ApiError::new(
                Code::Internal,
                format!("the appliance sent invalid JSON: {e}"),
            )
        })?;
        if status == 200 {
            Ok(v)
        } else {
            let code = crate::base::error::code_of(&v).unwrap_or(Code::Internal);
            let msg = v
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("no message")
                .to_string();
            Err(ApiError::new(code, msg))
        }
    }
}
