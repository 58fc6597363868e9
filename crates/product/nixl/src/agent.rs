//! The agent: a NIXL agent with one UCX backend, polled (no progress thread).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nixl_sys::{AgentConfig, NixlError, ThreadSync};

use crate::loader::{loaded_from, nixl_available};
use crate::Error;

/// The checked layer: every nixl-sys result passes here, so a failure names its call.
pub(crate) fn check<T>(call: &'static str, result: Result<T, NixlError>) -> Result<T, Error> {
    result.map_err(|e| Error::Nixl {
        call,
        status: e.to_string(),
    })
}

/// How [`Agent::with_options`] configures the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AgentOptions {
    /// Run NIXL's own progress thread (mx polls instead; see [`Agent::with_progress_thread`]).
    pub progress_thread: bool,
    /// UCX workers of the backend (NIXL's `num_workers`; `None` = the plugin's default).
    pub ucx_workers: Option<u32>,
}

/// One NIXL agent with the UCX backend and the progress thread off.
///
/// Cloning is cheap and shares the agent (an `Arc` inside). The agent lives until the last clone
/// and the last [`Arena`](crate::Arena) registered with it are dropped.
#[derive(Clone)]
pub struct Agent {
    pub(crate) inner: Arc<AgentInner>,
}

pub(crate) struct AgentInner {
    pub(crate) name: String,
    pub(crate) nixl: nixl_sys::Agent,
    pub(crate) backend: nixl_sys::Backend,
    /// Remote agents whose metadata is loaded.
    remotes: Mutex<BTreeSet<String>>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.inner.name)
            .finish_non_exhaustive()
    }
}

impl Agent {
    /// Creates the agent `name` with the UCX backend, its progress thread off (transfers progress
    /// while [`Agent::read`] polls them) and reader/writer locking inside NIXL, so one agent may be
    /// shared by threads.
    ///
    /// Names must be unique among the agents that exchange metadata.
    ///
    /// # Errors
    /// [`Error::NixlMissing`] when the NIXL libraries are not found (see the crate docs),
    /// [`Error::BadAgentName`] for an empty name or one with a NUL byte, [`Error::Nixl`] when NIXL
    /// cannot create the agent or the UCX backend (e.g. the plugin directory lacks
    /// `libplugin_UCX.so`).
    pub fn new(name: &str) -> Result<Agent, Error> {
        Agent::with_progress_thread(name, false)
    }

    /// As [`Agent::new`], choosing whether NIXL runs its own progress thread. mx keeps it off
    /// (on a 2-core machine a spinning progress thread competes with the transfer; FACTS.md
    /// measured 0.9-3.2 GB/s with it on against ~10 with polling); `true` exists to measure that.
    ///
    /// # Errors
    /// As [`Agent::new`].
    pub fn with_progress_thread(name: &str, progress_thread: bool) -> Result<Agent, Error> {
        Agent::with_options(
            name,
            AgentOptions {
                progress_thread,
                ucx_workers: None,
            },
        )
    }

    /// As [`Agent::new`] with explicit [`AgentOptions`].
    ///
    /// # Errors
    /// As [`Agent::new`]; [`Error::Nixl`] when the UCX backend refuses a parameter.
    pub fn with_options(name: &str, opts: AgentOptions) -> Result<Agent, Error> {
        let progress_thread = opts.progress_thread;
        if name.is_empty() {
            return Err(Error::BadAgentName {
                name: name.to_string(),
                reason: "empty",
            });
        }
        if name.contains('\0') {
            return Err(Error::BadAgentName {
                name: name.to_string(),
                reason: "contains a NUL byte",
            });
        }
        nixl_available()?;
        let config = AgentConfig {
            enable_prog_thread: progress_thread,
            enable_listen_thread: false,
            thread_sync: ThreadSync::Rw,
            ..AgentConfig::default()
        };
        let nixl = check(
            "nixl_capi_create_configured_agent",
            nixl_sys::Agent::new_configured(name, &config),
        )?;
        let (_mems, mut params) = check(
            "nixl_capi_get_plugin_params(UCX)",
            nixl.get_plugin_params("UCX"),
        )?;
        if let Some(n) = opts.ucx_workers {
            check(
                "nixl_capi_params_add(num_workers)",
                params.set("num_workers", &n.max(1).to_string()),
            )?;
        }
        let backend = check(
            "nixl_capi_create_backend(UCX)",
            nixl.create_backend("UCX", &params),
        )?;
        tracing::debug!(
            agent = name,
            nixl = loaded_from().unwrap_or("?"),
            "NIXL agent created"
        );
        Ok(Agent {
            inner: Arc::new(AgentInner {
                name: name.to_string(),
                nixl,
                backend,
                remotes: Mutex::new(BTreeSet::new()),
            }),
        })
    }

    /// This agent's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// This agent's metadata (connection info and registered memory), to hand to peers'
    /// [`Agent::load_remote`]. Call it after registering the arenas peers will read: memory
    /// registered later is not in it.
    ///
    /// # Errors
    /// [`Error::Nixl`] from `get_local_md`.
    pub fn local_metadata(&self) -> Result<Vec<u8>, Error> {
        check("nixl_capi_get_local_md", self.inner.nixl.get_local_md())
    }

    /// Loads a peer's metadata (from its [`Agent::local_metadata`]) and returns the peer's name.
    ///
    /// Loading the same metadata again is harmless and returns the same name. To replace a peer's
    /// metadata (it re-registered), [`Agent::invalidate_remote`] it first.
    ///
    /// # Errors
    /// [`Error::Nixl`] when NIXL rejects the bytes (garbled or truncated).
    pub fn load_remote(&self, metadata: &[u8]) -> Result<String, Error> {
        let mut remotes = self.remotes();
        let name = check(
            "nixl_capi_load_remote_md",
            self.inner.nixl.load_remote_md(metadata),
        )?;
        remotes.insert(name.clone());
        Ok(name)
    }

    /// Forgets a peer's metadata (e.g. when the peer exits or re-registers). Forgetting a peer
    /// that is not loaded is a no-op.
    ///
    /// # Errors
    /// [`Error::Nixl`] from `invalidate_remote_md`.
    pub fn invalidate_remote(&self, name: &str) -> Result<(), Error> {
        let mut remotes = self.remotes();
        if !remotes.contains(name) {
            return Ok(());
        }
        check(
            "nixl_capi_invalidate_remote_md",
            self.inner.nixl.invalidate_remote_md(name),
        )?;
        remotes.remove(name);
        Ok(())
    }

    /// Names of the peers whose metadata is loaded, sorted.
    pub fn remotes_loaded(&self) -> Vec<String> {
        self.remotes().iter().cloned().collect()
    }

    pub(crate) fn has_remote(&self, name: &str) -> bool {
        self.remotes().contains(name)
    }

    fn remotes(&self) -> MutexGuard<'_, BTreeSet<String>> {
        // A poisoned set is still a valid set of names.
        self.inner
            .remotes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Drives the UCX backend once: answers peers' connection set-up (wire-up) messages and
    /// collects notifications (discarded; mx uses none). With the progress thread off, an agent
    /// that only *serves* READs must call this now and then, or let [`Agent::spawn_progress`] do
    /// it: peers cannot connect to an agent that never progresses (their READs stay pending). The
    /// data itself moves without the serving side (one-sided).
    ///
    /// # Errors
    /// [`Error::Nixl`] from `get_notifs`.
    pub fn progress(&self) -> Result<(), Error> {
        let mut notifs = check(
            "nixl_capi_create_notif_map",
            nixl_sys::NotificationMap::new(),
        )?;
        check(
            "nixl_capi_get_notifs",
            self.inner.nixl.get_notifications(&mut notifs, None),
        )
    }

    /// Starts a thread that calls [`Agent::progress`] every `interval` (1-10 ms is plenty: only
    /// connection set-up waits on it) until the returned guard is dropped. Errors are logged.
    pub fn spawn_progress(&self, interval: Duration) -> ProgressThread {
        let stop = Arc::new(AtomicBool::new(false));
        let agent = self.clone();
        let flag = Arc::clone(&stop);
        let handle = std::thread::Builder::new()
            .name(format!("nixl-progress-{}", self.name()))
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    if let Err(e) = agent.progress() {
                        tracing::warn!(agent = agent.name(), error = %e, "NIXL progress failed");
                    }
                    std::thread::sleep(interval);
                }
            });
        match handle {
            Ok(handle) => ProgressThread {
                stop,
                handle: Some(handle),
            },
            Err(e) => {
                tracing::warn!(error = %e, "could not start the NIXL progress thread");
                ProgressThread { stop, handle: None }
            }
        }
    }

    pub(crate) fn same_agent(&self, other: &Agent) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// A background thread calling [`Agent::progress`]; stopped and joined on drop.
#[derive(Debug)]
pub struct ProgressThread {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Drop for ProgressThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}
