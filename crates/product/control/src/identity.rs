//! Which engine a worker's URL reaches (issue 29, item 1): a URL string proves nothing, since
//! `http://localhost:7711`, `http://127.1:7711/`, `http://[::ffff:127.0.0.1]:7711`,
//! `http://0x7f000001:7711` and a TCP proxy all reach one engine.
//!
//! Two defences, one at each end of a refit's reach:
//!
//! - **At registration, addresses**: [`engine_addresses`] reduces a URL to the socket addresses
//!   it reaches (the host as an IP address, IPv4 in any WHATWG spelling and IPv4-mapped IPv6
//!   as IPv4, names resolved, every loopback and unspecified address as one `loopback` host;
//!   the port as a number; the path without its trailing `/`). A registration whose engine
//!   shares an address with a connected worker that is not a rank of the same instance is
//!   refused (`crate::takeover`).
//! - **Before a refit calls an engine, the engine's own answer**: engines that embed mx answer
//!   which workers they serve ([`mx_adapters::identity`]): worker id, instance and a one-way
//!   digest of the registering process's incarnation. [`judge`] compares that answer with the
//!   workers the call is for (their ids and the incarnations the control plane accepted) and
//!   refuses the call, before anything is sent, when any of them is not in it. Address
//!   spellings the first check cannot see (another interface of the same host, a proxy) end
//!   here.
//! - **After a refit, the engine's version read back** (`crate::readback`): every worker
//!   outside a refit whose engine shares an address with one the refit calls (the other
//!   ranks of an instance, an id registered while the engine's own worker was away) is gated
//!   from the refit's BEGIN until the control plane has read its engine's version back itself
//!   and journaled it; admission then follows that answer, not what the worker reported.
//!
//! What each engine kind proves, and what stays trusted:
//!
//! | engine | proves | trusted |
//! |---|---|---|
//! | `mx worker`, the Python / C pullers' `serve` | worker id, instance, incarnation (`GET /mx/identity`) | nothing about the URL |
//! | vLLM with the mx backend (`mx.vllm`) | the same for every tensor-parallel rank (`POST /collective_rpc`, dev mode) | nothing about the URL |
//! | SGLang's own server, a Dynamo worker's system routes | nothing (no such route) | the address: unique among connected workers (`mx_engine_proofs_total{result="not_offered"}` counts the calls made on it) |
//!
//! Anyone who can reach an engine's routes with its token can drive it directly; the proof
//! stops the control plane itself from being steered onto another worker's engine.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use mx_adapters::{incarnation_digest, Proof};

/// How long a registration waits for a host name to resolve.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// The socket addresses an engine URL reaches, sorted: `host:port/path` with the host as
/// [`canonical_ip`] spells it (see the module docs). A name that does not resolve within 2 s is
/// kept as `name:<lowercase name>` (it reaches nothing yet; a later registration resolving it
/// compares by address).
///
/// # Errors
/// A message naming what is wrong when `url` is not an absolute http(s) URL with a host.
pub async fn engine_addresses(url: &str) -> Result<Vec<String>, String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("{url:?} is not a URL: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!("{url:?} is not an http(s) URL"));
    }
    let port = parsed
        .port_or_known_default()
        .ok_or_else(|| format!("{url:?} has no port"))?;
    let path = parsed.path().trim_end_matches('/').to_string();
    let hosts: BTreeSet<String> = match parsed.host() {
        Some(url::Host::Ipv4(ip)) => [canonical_ip(IpAddr::V4(ip))].into(),
        Some(url::Host::Ipv6(ip)) => [canonical_ip(IpAddr::V6(ip))].into(),
        Some(url::Host::Domain(name)) => resolve(name, port).await,
        None => return Err(format!("{url:?} has no host")),
    };
    Ok(hosts
        .into_iter()
        .map(|h| format!("{h}:{port}{path}"))
        .collect())
}

/// The host part of an address key: every loopback and unspecified address is `loopback` (a
/// server bound to `0.0.0.0` answers on each of them), an IPv4-mapped IPv6 address is its IPv4
/// address, IPv6 is bracketed.
pub(crate) fn canonical_ip(ip: IpAddr) -> String {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    if ip.is_loopback() || ip.is_unspecified() {
        return "loopback".into();
    }
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    }
}

async fn resolve(name: &str, port: u16) -> BTreeSet<String> {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    if name == "localhost" || name.ends_with(".localhost") {
        return ["loopback".to_string()].into();
    }
    match tokio::time::timeout(
        RESOLVE_TIMEOUT,
        tokio::net::lookup_host(format!("{name}:{port}")),
    )
    .await
    {
        Ok(Ok(addrs)) => {
            let set: BTreeSet<String> = addrs.map(|a| canonical_ip(a.ip())).collect();
            if set.is_empty() {
                [format!("name:{name}")].into()
            } else {
                set
            }
        }
        _ => [format!("name:{name}")].into(),
    }
}

/// One worker a call is for, as the control plane accepted its registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Expected {
    pub(crate) worker_id: String,
    pub(crate) instance: String,
    /// 0: an older client that sent none (only the id and instance are compared).
    pub(crate) incarnation: u64,
}

/// What [`judge`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The engine named every worker the call is for.
    Proven,
    /// The engine cannot prove anything (no identity route): why.
    Unproven(String),
    /// The engine named other workers, or these with another incarnation: refuse the call.
    Refused(String),
}

/// Judges an engine's `proof` against the workers a call is for (see the module docs).
pub(crate) fn judge(url: &str, proof: &Proof, expected: &[Expected]) -> Verdict {
    let served = match proof {
        Proof::NotOffered(why) => return Verdict::Unproven(why.clone()),
        Proof::Proven(served) => served,
    };
    let names = || {
        served
            .iter()
            .map(|s| format!("{} of instance {}", s.worker_id, s.instance))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for e in expected {
        let Some(s) = served.iter().find(|s| s.worker_id == e.worker_id) else {
            return Verdict::Refused(format!(
                "the engine at {url} says it serves {}, not worker {}: its URL reaches another worker's engine, so nothing was sent to it",
                names(),
                e.worker_id
            ));
        };
        if s.instance != e.instance {
            return Verdict::Refused(format!(
                "the engine at {url} serves worker {} of instance {}, but the worker registered instance {}",
                e.worker_id, s.instance, e.instance
            ));
        }
        if e.incarnation != 0 && s.incarnation_digest != incarnation_digest(e.incarnation) {
            return Verdict::Refused(format!(
                "the engine at {url} serves worker {} for another process than the one registered (its incarnation differs): the engine restarted or another process answers for it; it is called again after that process registers",
                e.worker_id
            ));
        }
    }
    Verdict::Proven
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)] // reason: tests fail loudly on purpose
mod tests {
    use super::*;
    use mx_adapters::EngineIdentity;

    async fn one(url: &str) -> String {
        let a = engine_addresses(url).await.unwrap();
        assert_eq!(a.len(), 1, "{url}: {a:?}");
        a.into_iter().next().unwrap()
    }

    #[tokio::test]
    async fn every_spelling_of_one_loopback_engine_is_one_address() {
        let want = "loopback:7711";
        for url in [
            "http://127.0.0.1:7711",
            "http://localhost:7711",
            "http://127.0.0.1:7711/",
            "http://127.1:7711",
            "http://[::ffff:127.0.0.1]:7711",
            "http://127.0.0.1:07711",
            "http://0x7f000001:7711",
            "http://LOCALHOST:7711",
            "http://[::1]:7711",
            "http://0.0.0.0:7711",
            "https://127.0.0.1:7711",
        ] {
            assert_eq!(one(url).await, want, "{url}");
        }
        assert_eq!(one("http://127.0.0.1:7712").await, "loopback:7712");
        assert_eq!(one("http://10.1.2.3").await, "10.1.2.3:80");
        assert_eq!(one("https://10.1.2.3/engine/").await, "10.1.2.3:443/engine");
        assert_eq!(one("http://[2001:db8::1]:9").await, "[2001:db8::1]:9");
        assert_eq!(
            one("http://no-such-host.invalid:5").await,
            "name:no-such-host.invalid:5"
        );
        for bad in ["ftp://127.0.0.1:1", "not a url", "http://"] {
            assert!(engine_addresses(bad).await.is_err(), "{bad}");
        }
    }

    fn id(w: &str, inst: &str, incarnation: u64) -> EngineIdentity {
        EngineIdentity {
            worker_id: w.into(),
            instance: inst.into(),
            incarnation_digest: incarnation_digest(incarnation),
        }
    }

    fn want(w: &str, inst: &str, incarnation: u64) -> Expected {
        Expected {
            worker_id: w.into(),
            instance: inst.into(),
            incarnation,
        }
    }

    #[test]
    fn an_engine_is_called_only_for_the_workers_it_names() {
        let u = "http://e";
        let tp2 = Proof::Proven(vec![id("i-tp0", "i", 1), id("i-tp1", "i", 2)]);
        assert_eq!(
            judge(u, &tp2, &[want("i-tp0", "i", 1), want("i-tp1", "i", 2)]),
            Verdict::Proven
        );
        let Verdict::Refused(why) = judge(u, &tp2, &[want("x", "x", 9)]) else {
            panic!("an alias must be refused");
        };
        assert!(
            why.contains("not worker x") && why.contains("i-tp0"),
            "{why}"
        );
        let Verdict::Refused(why) = judge(u, &tp2, &[want("i-tp0", "i", 7)]) else {
            panic!("another incarnation must be refused");
        };
        assert!(why.contains("incarnation differs"), "{why}");
        let Verdict::Refused(why) = judge(u, &tp2, &[want("i-tp0", "j", 1)]) else {
            panic!("another instance must be refused");
        };
        assert!(why.contains("instance j"), "{why}");
        // An older client without an incarnation: id and instance only.
        assert_eq!(judge(u, &tp2, &[want("i-tp1", "i", 0)]), Verdict::Proven);
        assert_eq!(
            judge(
                u,
                &Proof::NotOffered("no route".into()),
                &[want("x", "x", 1)]
            ),
            Verdict::Unproven("no route".into())
        );
    }
}
