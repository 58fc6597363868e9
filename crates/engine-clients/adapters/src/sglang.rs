//! Client for SGLang's own server (`python -m sglang.launch_server`, sglang 0.5.23) with mx's
//! loader in its scheduler processes (`--custom-weight-loader mx.sglang.load`, the Python
//! package `mx.sglang`); the wire values both sides use are in [`wire`].
//!
//! Routes (`sglang/srt/entrypoints/http_server.py` at 0.5.23; the bodies are
//! `sglang/srt/managers/io_struct.py`'s structs):
//! - `POST /pause_generation` `{mode: abort|retract|in_place}` → 200 `{message, status: "ok"}`.
//! - `POST /begin_weight_update` `{selector: "all"}` → 200 `{success: true, message:
//!   "Success"}`; 400 `{success: false, message: "a weight-update session is already open;
//!   call end_weight_update() first"}`.
//! - `POST /update_weights_from_tensor` `{serialized_named_tensors: [one per TP rank],
//!   load_format: "mx.sglang.load", flush_cache: false, weight_version: V}` → 200 `{success:
//!   true, message: "Success Weight version updated to V."}`; 400 outside a session. Each rank
//!   unpickles its element with SGLang's allowlisting unpickler and calls the loader with
//!   `[(name, tensor)]`: mx sends one entry whose *name* is the version id to install
//!   ([`marker`]) and whose tensor is empty, so no weight bytes cross HTTP: each rank's loader
//!   installs the version its own mx puller staged (pulled over NIXL while SGLang generated).
//!   An exception in a custom loader kills the server (SGLang does not catch it), so mx's
//!   loader never raises: a failed install restores the previous version and is reported by
//!   the rank to the control plane (`ReportResident`), while SGLang still answers success and
//!   records V ([`crate::EngineApi::resident_from_ranks`]).
//! - `POST /end_weight_update` `{}` → 200 `{success: true}`; 400 when no session is open.
//! - `POST /flush_cache` (no body) → 200 text `"Cache flushed. ..."`; 400 text when refused
//!   (requests still running or queued: an `in_place` pause holds them).
//! - `GET /model_info` → `{weight_version, model_path, ...}` (`weight_version` is `"default"`
//!   until an update names one).
//! - `GET /server_info` → `{tp_size, ...}`.
//! - `POST /continue_generation` `{torch_empty_cache: false}` → 200 `{message, status: "ok"}`.
//! - `POST /generate` `{input_ids, sampling_params}` → 200 `{output_ids, meta_info}`
//!   ([`crate::generate`]).
//!
//! Validation errors answer 400 `{object: "error", message, ...}`.

pub mod wire;

use std::time::Duration;

use base64::Engine as _;
use mx_layout::ResidentVersion;

use crate::engine::{Answer, ApplyAnswer, EngineClient, PauseMode, SglangPause};
use crate::generate::Generation;
use crate::{send, send_typed, snippet, Error};
use wire::{
    BeginRequest, ContinueRequest, ErrorResponse, ModelInfo, PauseRequest, ServerInfo,
    StatusResponse, UpdateFromTensorRequest, UpdateResponse,
};

/// The loader mx's Python package provides (`mx.sglang.load`): the value of `load_format` in
/// `/update_weights_from_tensor`, and what a server lists in `--custom-weight-loader`.
pub const LOADER: &str = "mx.sglang.load";

/// The longest version id a marker carries (bytes).
const MAX_MARKER_NAME: usize = 4096;

/// Pickle protocol 2 of `[(NAME, torch.empty(0, dtype=torch.uint8))]` as torch 2.13 writes it,
/// cut around NAME's `BINUNICODE` opcode: these bytes before it...
const MARKER_PREFIX: &[u8] = b"\x80\x02]q\x00";
/// ...and these after it (base64): the empty uint8 tensor, through
/// `torch._utils._rebuild_tensor_v2` and `torch.storage._load_from_bytes`, the globals SGLang's
/// `SafeUnpickler` allows.
const MARKER_SUFFIX_B64: &str = "cQFjdG9yY2guX3V0aWxzCl9yZWJ1aWxkX3RlbnNvcl92MgpxAihjdG9yY2guc3RvcmFnZQpfbG9hZF9mcm9tX2J5dGVzCnEDY19jb2RlY3MKZW5jb2RlCnEEWAcBAADCgALCigpsw7zCnEbDuSBqwqhQGS7CgAJNw6kDLsKAAn1xAChYEAAAAHByb3RvY29sX3ZlcnNpb25xAU3DqQNYDQAAAGxpdHRsZV9lbmRpYW5xAsKIWAoAAAB0eXBlX3NpemVzcQN9cQQoWAUAAABzaG9ydHEFSwJYAwAAAGludHEGSwRYBAAAAGxvbmdxB0sEdXUuwoACKFgHAAAAc3RvcmFnZXEAY3RvcmNoCkJ5dGVTdG9yYWdlCnEBWA4AAAA5MzkxMDEwNDExNDgzMnECWAMAAABjcHVxA0sATnRxBFEuwoACXXEAWA4AAAA5MzkxMDEwNDExNDgzMnEBYS4AAAAAAAAAAHEFWAYAAABsYXRpbjFxBoZxB1JxCIVxCVJxCksASwCFcQtLAYVxDIljY29sbGVjdGlvbnMKT3JkZXJlZERpY3QKcQ0pUnEOdHEPUnEQhnERYS4=";

/// The serialized `[(name, empty tensor)]` one rank reads from `/update_weights_from_tensor`:
/// base64 of a pickle whose only entry is named `name` (a version id for mx's loader), written
/// from a template captured from torch (no Python here).
///
/// # Errors
/// [`Error::Unappliable`] for an empty name or one longer than 4096 bytes.
pub fn marker(name: &str) -> Result<String, Error> {
    if name.is_empty() || name.len() > MAX_MARKER_NAME {
        return Err(Error::Unappliable {
            version: name.chars().take(80).collect(),
            reason: "a version id for SGLang's loader is 1 to 4096 bytes",
        });
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let suffix = b64
        .decode(MARKER_SUFFIX_B64)
        .map_err(|_| Error::Unsupported {
            what: "a decodable marker template (a defect of this build)".into(),
        })?;
    // The length fits: checked above.
    let len = u32::try_from(name.len()).unwrap_or(u32::MAX).to_le_bytes();
    let mut out = Vec::with_capacity(MARKER_PREFIX.len() + 5 + name.len() + suffix.len());
    out.extend_from_slice(MARKER_PREFIX);
    out.push(b'X');
    out.extend_from_slice(&len);
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&suffix);
    Ok(b64.encode(out))
}

/// The name a [`marker`] carries (the inverse of [`marker`], for engines that serve SGLang's
/// contract in Rust: mx's reference worker).
///
/// # Errors
/// In words, for text that is not base64 of a marker this build writes.
pub fn marker_name(serialized: &str) -> Result<String, String> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let raw = b64
        .decode(serialized)
        .map_err(|e| format!("not base64: {e}"))?;
    let suffix = b64
        .decode(MARKER_SUFFIX_B64)
        .map_err(|_| "the marker template does not decode (a defect of this build)".to_string())?;
    let rest = raw
        .strip_prefix(MARKER_PREFIX)
        .and_then(|r| r.strip_prefix(b"X"))
        .ok_or("not a pickled [(name, tensor)] list mx writes (its opening bytes differ)")?;
    let (len, rest) = rest
        .split_first_chunk::<4>()
        .ok_or("cut short before the name's length")?;
    let len = usize::try_from(u32::from_le_bytes(*len)).map_err(|_| "name length overflows")?;
    if len == 0 || len > MAX_MARKER_NAME {
        return Err(format!("a name of {len} bytes (1 to {MAX_MARKER_NAME})"));
    }
    let (name, tail) = rest
        .split_at_checked(len)
        .ok_or("cut short inside the name")?;
    if tail != suffix.as_slice() {
        return Err("its tensor is not the empty uint8 tensor mx writes".into());
    }
    String::from_utf8(name.to_vec()).map_err(|_| "the name is not UTF-8".to_string())
}

/// The body of an `update_weights_from_tensor` naming `version` to mx's loader on each of
/// `tp_size` ranks (at least one), SGLang recording `version` on success and flushing its cache
/// after the load when `flush_cache`.
///
/// # Errors
/// [`Error::Unappliable`] for a version no marker can carry.
pub fn tensor_update(
    version: &str,
    tp_size: u32,
    flush_cache: bool,
) -> Result<UpdateFromTensorRequest, Error> {
    let one = marker(version)?;
    Ok(UpdateFromTensorRequest {
        serialized_named_tensors: vec![one; tp_size.max(1) as usize],
        load_format: Some(LOADER.into()),
        flush_cache: Some(flush_cache),
        weight_version: Some(version.into()),
    })
}

/// One SGLang server's routes, at its base URL.
#[derive(Debug, Clone)]
pub struct SglangClient {
    http: reqwest::Client,
    base_url: String,
    timeout: Duration,
}

impl SglangClient {
    /// A client for the server at `base_url`; every call has `timeout` as its deadline.
    pub fn new(base_url: &str, timeout: Duration) -> SglangClient {
        SglangClient::with_client(reqwest::Client::new(), base_url, timeout)
    }

    /// As [`SglangClient::new`], sharing `http` with other clients.
    pub fn with_client(http: reqwest::Client, base_url: &str, timeout: Duration) -> SglangClient {
        SglangClient {
            http,
            base_url: base_url.trim_end_matches('/').to_string(),
            timeout,
        }
    }

    fn url(&self, route: &str) -> String {
        format!("{}/{route}", self.base_url)
    }

    /// POSTs `body` to `route`; 200 with `{status: "ok"}` is success.
    async fn post_status<Req: serde::Serialize>(
        &self,
        route: &str,
        body: &Req,
    ) -> Result<String, Error> {
        let url = self.url(route);
        let (status, raw) = send(&url, self.http.post(&url).json(body), self.timeout).await?;
        match serde_json::from_str::<StatusResponse>(&raw) {
            Ok(r) if status == 200 && r.status == "ok" => Ok(r.message),
            Ok(_) if status == 200 => Err(Error::BadResponse {
                url,
                reason: format!("status is not \"ok\": {}", snippet(&raw)),
            }),
            _ => Err(status_error(url, status, &raw)),
        }
    }

    /// POSTs `body` to a weight-update route; 200 with `success: true` is success.
    async fn post_update<Req: serde::Serialize>(
        &self,
        route: &str,
        body: &Req,
    ) -> Result<String, Error> {
        let url = self.url(route);
        let (status, raw) = send(&url, self.http.post(&url).json(body), self.timeout).await?;
        match serde_json::from_str::<UpdateResponse>(&raw) {
            Ok(r) if r.success && status == 200 => Ok(r.message),
            Ok(r) if !r.success => Err(Error::Engine {
                url,
                message: r.message,
            }),
            Ok(_) => Err(Error::Status {
                url,
                status,
                body: snippet(&raw),
            }),
            Err(_) => Err(status_error(url, status, &raw)),
        }
    }

    /// `POST /pause_generation` with `{mode}`.
    ///
    /// # Errors
    /// [`Error::Status`] (with SGLang's message for a 400), [`Error::BadResponse`] unless the
    /// body says `status: "ok"`, [`Error::Timeout`], [`Error::Http`].
    pub async fn pause_generation(&self, mode: SglangPause) -> Result<String, Error> {
        self.post_status("pause_generation", &PauseRequest { mode: Some(mode) })
            .await
    }

    /// `POST /continue_generation` with `{torch_empty_cache}`.
    ///
    /// # Errors
    /// As [`SglangClient::pause_generation`].
    pub async fn continue_generation(&self, torch_empty_cache: bool) -> Result<String, Error> {
        let body = ContinueRequest {
            torch_empty_cache: Some(torch_empty_cache),
        };
        self.post_status("continue_generation", &body).await
    }

    /// `POST /begin_weight_update` with `{selector: "all"}`.
    ///
    /// # Errors
    /// [`Error::Engine`] with SGLang's message when `success` is false (a session is open
    /// already); [`Error::Status`], [`Error::Timeout`], [`Error::Http`].
    pub async fn begin_weight_update(&self) -> Result<String, Error> {
        let body = BeginRequest {
            selector: Some("all".into()),
        };
        self.post_update("begin_weight_update", &body).await
    }

    /// `POST /update_weights_from_tensor` naming `version` to mx's loader on each of `tp_size`
    /// ranks, SGLang recording `version` on success, no flush (see [`SglangClient::flush_cache`]).
    ///
    /// # Errors
    /// [`Error::Unappliable`] for a version no marker can carry; as
    /// [`SglangClient::begin_weight_update`] (400 outside a session).
    pub async fn update_weights_from_tensor(
        &self,
        version: &str,
        tp_size: u32,
    ) -> Result<String, Error> {
        let body = tensor_update(version, tp_size, false)?;
        self.post_update("update_weights_from_tensor", &body).await
    }

    /// `POST /end_weight_update` with `{}`.
    ///
    /// # Errors
    /// As [`SglangClient::begin_weight_update`] (no session open).
    pub async fn end_weight_update(&self) -> Result<String, Error> {
        self.post_update("end_weight_update", &serde_json::json!({}))
            .await
    }

    /// `POST /flush_cache`: SGLang's radix (prefix) cache and KV pool; refused while requests
    /// run or wait.
    ///
    /// # Errors
    /// [`Error::Engine`] with SGLang's text when it refused; [`Error::Status`] for another
    /// status, [`Error::Timeout`], [`Error::Http`].
    pub async fn flush_cache(&self) -> Result<String, Error> {
        let url = self.url("flush_cache");
        let (status, raw) = send(&url, self.http.post(&url), self.timeout).await?;
        match status {
            200 => Ok(raw.trim().to_string()),
            400 => Err(Error::Engine {
                url,
                message: raw.trim().to_string(),
            }),
            status => Err(Error::Status {
                url,
                status,
                body: snippet(&raw),
            }),
        }
    }

    /// `GET /model_info`.
    ///
    /// # Errors
    /// [`Error::Status`], [`Error::BadResponse`], [`Error::Timeout`], [`Error::Http`].
    pub async fn model_info(&self) -> Result<ModelInfo, Error> {
        let url = self.url("model_info");
        send_typed(&url, self.http.get(&url), self.timeout).await
    }

    /// `GET /server_info`'s `tp_size`.
    ///
    /// # Errors
    /// As [`SglangClient::model_info`].
    pub async fn tp_size(&self) -> Result<u32, Error> {
        let url = self.url("server_info");
        let r: ServerInfo = send_typed(&url, self.http.get(&url), self.timeout).await?;
        Ok(r.tp_size)
    }

    /// Flushes the cache; when SGLang refuses because an `in_place` pause holds requests,
    /// retracts them (a second pause, `retract`: they go back to the queue and are recomputed
    /// with the new weights on continue, as mx's vLLM client preempts held requests) and flushes
    /// again.
    async fn flush_retracting(&self) -> Result<String, Error> {
        match self.flush_cache().await {
            Ok(m) => Ok(m),
            Err(Error::Engine { .. }) => {
                self.pause_generation(SglangPause::Retract).await?;
                self.flush_cache().await
            }
            Err(e) => Err(e),
        }
    }
}

/// A non-success answer: SGLang's `ErrorResponse` message when the body is one.
fn status_error(url: String, status: u16, raw: &str) -> Error {
    let body = match serde_json::from_str::<ErrorResponse>(raw) {
        Ok(e) if !e.message.is_empty() => e.message,
        _ => snippet(raw),
    };
    Error::Status { url, status, body }
}

/// The refit's calls on SGLang's own server: pause with SGLang's mode ([`SglangPause::of`]);
/// apply as one weight-update session naming the version to mx's loader, then a cache flush
/// (retracting what an `in_place` pause held); the version read back from `/model_info`
/// (an echo of what the update named: the control plane takes the resident version from the
/// ranks' own reports); continue; generation over `/generate`.
#[async_trait::async_trait]
impl EngineClient for SglangClient {
    async fn pause(&self, mode: PauseMode) -> Result<Answer, Error> {
        let mode = SglangPause::of(mode)?;
        self.pause_generation(mode).await?;
        Ok(Answer {
            message: format!("paused ({})", mode.as_str()),
            version: None,
        })
    }

    async fn apply(&self, version: &ResidentVersion) -> Result<ApplyAnswer, Error> {
        let v = version.to_string();
        marker(&v)?;
        let step = |step: &'static str, installed: Option<String>| {
            move |e: Error| Error::ApplyStep {
                step,
                installed,
                source: Box::new(e),
            }
        };
        let tp = self.tp_size().await.map_err(step("server_info", None))?;
        if let Err(e) = self.begin_weight_update().await {
            // A session a failed apply left open: close it and begin again, once.
            if !matches!(e, Error::Engine { .. }) {
                return Err(step("begin_weight_update", None)(e));
            }
            self.end_weight_update()
                .await
                .map_err(step("end_weight_update", None))?;
            self.begin_weight_update()
                .await
                .map_err(step("begin_weight_update", None))?;
        }
        let message = match self.update_weights_from_tensor(&v, tp).await {
            Ok(m) => m,
            Err(e) => {
                // Close the session; the update's error is the one to report.
                let _ = self.end_weight_update().await;
                return Err(step("update_weights_from_tensor", None)(e));
            }
        };
        self.end_weight_update()
            .await
            .map_err(step("end_weight_update", Some(v.clone())))?;
        self.flush_retracting()
            .await
            .map_err(step("flush_cache", Some(v.clone())))?;
        Ok(ApplyAnswer {
            message,
            version: None,
            cache_tiers_cleared: vec!["radix_cache".into(), "kv_cache".into()],
            paused_requests: 0,
            steps: Vec::new(),
        })
    }

    async fn read_version(&self) -> Result<Answer, Error> {
        let info = self.model_info().await?;
        match info.weight_version {
            Some(v) => Ok(Answer {
                message: String::new(),
                version: Some(ResidentVersion::parse(&v)),
            }),
            None => Err(Error::NoVersion {
                url: self.url("model_info"),
            }),
        }
    }

    async fn resume(&self) -> Result<Answer, Error> {
        let message = self.continue_generation(false).await?;
        Ok(Answer {
            message,
            version: None,
        })
    }

    async fn generate(&self, prompt: &[u32], max_new_tokens: u32) -> Result<Generation, Error> {
        crate::generate::generate(
            &self.http,
            &self.base_url,
            prompt,
            max_new_tokens,
            self.timeout,
        )
        .await
    }

    async fn identify(&self) -> Result<crate::identity::Proof, Error> {
        Ok(crate::identity::Proof::NotOffered(
            "SGLang's own server has no identity route: its ranks' mx workers are known by the \
             address they registered"
                .into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The marker is the template with the name spliced in: the same bytes around it, the
    /// name's length little-endian before it.
    #[test]
    fn marker_splices_the_name_into_the_template() {
        let b64 = base64::engine::general_purpose::STANDARD;
        let name = "mx:".to_string() + &"ab".repeat(32);
        let raw = b64.decode(marker(&name).unwrap()).unwrap();
        let suffix = b64.decode(MARKER_SUFFIX_B64).unwrap();
        assert_eq!(&raw[..5], MARKER_PREFIX);
        assert_eq!(raw[5], b'X');
        assert_eq!(&raw[6..10], &67u32.to_le_bytes());
        assert_eq!(&raw[10..77], name.as_bytes());
        assert_eq!(&raw[77..], &suffix[..]);
        assert_eq!(
            raw.len(),
            517,
            "torch's own pickle of the same list is 517 bytes"
        );
        assert_eq!(raw.last(), Some(&b'.'), "a pickle ends with STOP");
        assert!(matches!(marker(""), Err(Error::Unappliable { .. })));
        assert!(matches!(
            marker(&"x".repeat(MAX_MARKER_NAME + 1)),
            Err(Error::Unappliable { .. })
        ));
    }
}
