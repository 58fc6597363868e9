//! Staging from artifacts in a real S3-compatible server (moto, started on loopback per test):
//! SmolLM2-135M exported canonical and as an XOR delta, staged into a vLLM-style tp=3 puller with
//! ranged reads, verified, applied, and compared byte for byte with slices of the tensors taken
//! independently of the planner. Faults: a corrupt and a missing delta object, a delta against a
//! base the worker does not hold, an object store that never answers.
//!
//! Needs NIXL (staging buffers are registered), `.mx/models/smollm2-135m` and `moto_server`
//! (`.mx/venv/bin/moto_server`, or `MX_MOTO_SERVER`; see `mx_harness::s3`); without them the tests print a skip
//! message and pass, unless `MX_REQUIRE_NIXL=1` (CI), where they fail.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)] // tests: panics are failures

use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use mx_artifact::{
    export_canonical, export_delta, ArtifactSource, ArtifactUrl, Chain, DeltaBase, ExportOptions,
    ExportRequest, Store, StoreOptions, WholeTensor, DEFAULT_CHAIN_LIMIT,
};
use mx_checkpoint::Checkpoint;
use mx_layout::{
    rank_layout, rank_layouts, version_digest, Digest, LayoutSpec, ModelInfo, RankLayout,
    ShardEntry, TensorSpec, VersionId,
};
use mx_nixl::Agent;
use mx_puller::exec::ExecOptions;
use mx_puller::{Error, Puller, PullerConfig};

use common::{repo, rt};

/// A loopback S3 server and a client factory for it.
struct Moto(mx_harness::s3::LoopbackS3);

impl Moto {
    fn start() -> Moto {
        Moto(mx_harness::s3::LoopbackS3::start().unwrap())
    }

    fn bucket(&self, name: &str) {
        self.0.bucket(name).unwrap();
    }

    fn store(&self, url: &ArtifactUrl) -> Store {
        Store::from_vars(url, StoreOptions::default(), self.0.vars()).unwrap()
    }
}

fn required(test: &str, what: &str) -> bool {
    if std::env::var("MX_REQUIRE_NIXL").as_deref() == Ok("1") {
        panic!("{test}: MX_REQUIRE_NIXL=1 but {what}");
    }
    eprintln!("SKIPPED {test}: {what}");
    false
}

/// What every test needs, or a skip.
fn ready(test: &str) -> bool {
    if !mx_nixl::nixl_or_skip(test) {
        return false;
    }
    if !repo().join(".mx/models/smollm2-135m/config.json").exists() {
        return required(
            test,
            ".mx/models/smollm2-135m is missing (run scripts/setup.sh)",
        );
    }
    if mx_harness::s3::moto_binary().is_none() {
        return required(test, "moto_server is missing (run scripts/setup.sh)");
    }
    true
}

/// One version: whole tensors, its trainer shards (FSDP-2, digested independently) and id.
struct Version {
    specs: Vec<TensorSpec>,
    bytes: Vec<Vec<u8>>,
    shards: Vec<ShardEntry>,
    id: VersionId,
}

impl Version {
    fn new(model: &ModelInfo, specs: Vec<TensorSpec>, bytes: Vec<Vec<u8>>) -> Version {
        let by_name: HashMap<&str, usize> = specs
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.as_str(), i))
            .collect();
        let fsdp: LayoutSpec = "fsdp:2".parse().unwrap();
        let mut shards = Vec::new();
        for r in 0..2 {
            for mut s in rank_layout(model, fsdp, r).unwrap().shard_entries(0) {
                let i = by_name[s.tensor.as_str()];
                s.digest = Digest::of(&common::slice(&bytes[i], &specs[i], &s.shard));
                shards.push(s);
            }
        }
        let id = VersionId(version_digest(&shards));
        Version {
            specs,
            bytes,
            shards,
            id,
        }
    }

    fn whole(&self) -> Vec<WholeTensor<'_>> {
        self.specs
            .iter()
            .zip(&self.bytes)
            .map(|(spec, bytes)| WholeTensor { spec, bytes })
            .collect()
    }

    /// A rank's live bytes, built element by element from the whole tensors.
    fn reference(&self, rl: &RankLayout) -> Vec<u8> {
        common::reference_rank(rl, &self.specs, &self.bytes)
    }
}

/// SmolLM2's checkpoint (v1) and a training step's worth of change (v2): about one element in
/// 64 of each tensor gets its low mantissa byte changed, as a small-lr bf16 step does.
fn versions() -> (ModelInfo, Version, Version) {
    let ck = Checkpoint::open(&repo().join(".mx/models/smollm2-135m")).unwrap();
    let model = ModelInfo::from_hf_config(ck.config().unwrap(), ck.specs()).unwrap();
    let specs = ck.specs();
    let v1: Vec<Vec<u8>> = specs
        .iter()
        .map(|s| ck.tensor(&s.name).unwrap().data.to_vec())
        .collect();
    let v2: Vec<Vec<u8>> = v1
        .iter()
        .map(|b| {
            let mut b = b.clone();
            for i in (0..b.len()).step_by(128) {
                b[i] ^= 0x5a;
            }
            b
        })
        .collect();
    let a = Version::new(&model, specs.clone(), v1);
    let b = Version::new(&model, specs, v2);
    (model, a, b)
}

fn tp3(model: &ModelInfo) -> Vec<RankLayout> {
    rank_layouts(model, "tp:3".parse().unwrap()).unwrap()
}

/// A puller of both ranks of tp:3 with host memory filled with 0xAA.
fn puller(model: &ModelInfo, name: &str) -> Puller {
    let mut p = Puller::new(
        PullerConfig {
            model: model.clone(),
            layout: "tp:3".parse().unwrap(),
            ranks: vec![0, 1, 2],
            retain: true,
        },
        Some(Agent::new(name).unwrap()),
    )
    .unwrap();
    for rl in p.rank_layouts().to_vec() {
        p.register_rank(rl.rank, Box::new(vec![0xAAu8; rl.total_bytes as usize]))
            .unwrap();
    }
    p
}

fn live(p: &Puller) -> Vec<Vec<u8>> {
    let n = p.rank_layouts().len();
    (0..n).map(|i| p.host_rank(i).unwrap().to_vec()).collect()
}

/// Exports v1 canonical and v2 as a delta against it; returns their URLs and manifest digests.
fn export_both(
    rt: &tokio::runtime::Runtime,
    store: &Store,
    bucket: &str,
    model: &ModelInfo,
    v1: &Version,
    v2: &Version,
) -> ((ArtifactUrl, Digest), (ArtifactUrl, Digest)) {
    let layouts = vec![tp3(model)];
    let u1: ArtifactUrl = format!("s3://{bucket}/run/v1").parse().unwrap();
    let u2: ArtifactUrl = format!("s3://{bucket}/run/v2").parse().unwrap();
    let (w1, w2) = (v1.whole(), v2.whole());
    let opts = ExportOptions::default();
    let e1 = rt
        .block_on(export_canonical(
            store,
            &u1,
            &ExportRequest {
                version: v1.id,
                label: Some("step-1"),
                shards: &v1.shards,
                tensors: &w1,
                layouts: &layouts,
            },
            &[("config.json".into(), b"{}".to_vec())],
            &opts,
        ))
        .unwrap();
    let e2 = rt
        .block_on(export_delta(
            store,
            &u2,
            &ExportRequest {
                version: v2.id,
                label: Some("step-2"),
                shards: &v2.shards,
                tensors: &w2,
                layouts: &layouts,
            },
            &DeltaBase {
                version: v1.id,
                url: Some(&u1),
                tensors: &w1,
            },
            &opts,
        ))
        .unwrap();
    let total: u64 = v1.bytes.iter().map(|b| b.len() as u64).sum();
    assert!(e1.data_bytes > total, "{} <= {total}", e1.data_bytes);
    assert!(
        e2.data_bytes < total / 2,
        "delta {} of {total}",
        e2.data_bytes
    );
    ((u1, e1.manifest_digest), (u2, e2.manifest_digest))
}

fn source(
    rt: &tokio::runtime::Runtime,
    store: &Store,
    url: &ArtifactUrl,
    digest: Digest,
    held: Option<VersionId>,
) -> Result<Arc<ArtifactSource>, mx_artifact::Error> {
    let chain = rt.block_on(Chain::resolve(
        store,
        url,
        Some(digest),
        held,
        DEFAULT_CHAIN_LIMIT,
    ))?;
    Ok(Arc::new(ArtifactSource::new(
        store.clone(),
        chain,
        rt.handle().clone(),
    )?))
}

#[test]
fn canonical_then_delta_stage_the_exact_bytes() {
    if !ready("canonical_then_delta_stage_the_exact_bytes") {
        return;
    }
    let moto = Moto::start();
    moto.bucket("mx-art");
    let rt = rt();
    let (model, v1, v2) = versions();
    let store = moto.store(&"s3://mx-art".parse().unwrap());
    let ((u1, d1), (u2, d2)) = export_both(&rt, &store, "mx-art", &model, &v1, &v2);

    // The canonical artifact is a Hugging Face checkpoint: index + safetensors files parse.
    let idx = rt
        .block_on(async {
            use object_store::ObjectStoreExt as _;
            store
                .object_store()
                .get(&u1.key("model.safetensors.index.json"))
                .await?
                .bytes()
                .await
        })
        .unwrap();
    let idx: serde_json::Value = serde_json::from_slice(&idx).unwrap();
    let file = idx["weight_map"]["model.embed_tokens.weight"]
        .as_str()
        .unwrap()
        .to_string();
    let body = rt
        .block_on(async {
            use object_store::ObjectStoreExt as _;
            store
                .object_store()
                .get(&u1.key(&file))
                .await?
                .bytes()
                .await
        })
        .unwrap();
    let st = safetensors::SafeTensors::deserialize(&body).unwrap();
    let emb = st.tensor("model.embed_tokens.weight").unwrap();
    let i = v1
        .specs
        .iter()
        .position(|s| s.name == "model.embed_tokens.weight")
        .unwrap();
    assert_eq!(emb.data(), &v1.bytes[i][..]);

    let dest = tp3(&model);
    let mut p = puller(&model, "art-canon");
    let s1 = source(&rt, &store, &u1, d1, None).unwrap();
    let r1 = p
        .stage_artifact(v1.id, Arc::clone(&s1), &ExecOptions::default())
        .unwrap();
    assert_eq!(r1.source, "artifact_canonical");
    p.apply(v1.id).unwrap();
    let want1: Vec<Vec<u8>> = dest.iter().map(|rl| v1.reference(rl)).collect();
    assert!(live(&p) == want1, "v1 from the canonical artifact differs");
    // Both ranks together need every byte once: fetched ~ the model (gaps of merged GETs aside).
    let total: u64 = v1.bytes.iter().map(|b| b.len() as u64).sum();
    assert!(
        r1.wire_bytes >= total && r1.wire_bytes < total + total / 10,
        "{}",
        r1.wire_bytes
    );

    // v2 from the delta onto the resident v1.
    let s2 = source(&rt, &store, &u2, d2, Some(v1.id)).unwrap();
    assert!(s2.chain().canonical().is_none());
    let r2 = p
        .stage_artifact(v2.id, s2, &ExecOptions::default())
        .unwrap();
    assert_eq!(r2.source, "artifact_delta");
    assert!(
        r2.wire_bytes < total / 2,
        "delta wire {} of {total}",
        r2.wire_bytes
    );
    p.apply(v2.id).unwrap();
    let want2: Vec<Vec<u8>> = dest.iter().map(|rl| v2.reference(rl)).collect();
    assert!(live(&p) == want2, "v2 from the delta differs");
    eprintln!(
        "tp:3 both ranks: canonical {} bytes in {} GETs, delta {} bytes in {} GETs",
        r1.wire_bytes, r1.descriptors, r2.wire_bytes, r2.descriptors
    );

    // A worker holding nothing reaches v2 through the chain: canonical v1, then the delta.
    let mut q = puller(&model, "art-chain");
    let s = source(&rt, &store, &u2, d2, None).unwrap();
    assert_eq!(s.chain().deltas().len(), 1);
    assert!(s.chain().canonical().is_some());
    q.stage_artifact(v2.id, s, &ExecOptions::default()).unwrap();
    q.apply(v2.id).unwrap();
    assert!(live(&q) == want2, "v2 through the chain differs");

    // One rank alone reads about half.
    let mut one = Puller::new(
        PullerConfig {
            model: model.clone(),
            layout: "tp:3".parse().unwrap(),
            ranks: vec![1],
            retain: false,
        },
        Some(Agent::new("art-one").unwrap()),
    )
    .unwrap();
    one.register_rank(1, Box::new(vec![0u8; dest[1].total_bytes as usize]))
        .unwrap();
    let r = one
        .stage_artifact(
            v1.id,
            source(&rt, &store, &u1, d1, None).unwrap(),
            &ExecOptions::default(),
        )
        .unwrap();
    one.apply(v1.id).unwrap();
    assert!(one.host_rank(0).unwrap() == want1[1].as_slice());
    // Its third of the column-parallel weights and vocab, and the row-parallel weights whole:
    // their 384-byte column slices with 768-byte gaps are read in merged GETs, not 576 each.
    assert!(
        r.wire_bytes < total * 6 / 10,
        "rank 1 alone fetched {} of {total}",
        r.wire_bytes
    );
}

#[test]
fn corrupt_missing_and_foreign_deltas_are_refused() {
    if !ready("corrupt_missing_and_foreign_deltas_are_refused") {
        return;
    }
    let moto = Moto::start();
    moto.bucket("mx-bad");
    let rt = rt();
    let (model, v1, v2) = versions();
    let store = moto.store(&"s3://mx-bad".parse().unwrap());
    let ((u1, d1), (u2, d2)) = export_both(&rt, &store, "mx-bad", &model, &v1, &v2);
    let dest = tp3(&model);
    let want1: Vec<Vec<u8>> = dest.iter().map(|rl| v1.reference(rl)).collect();
    let mut p = puller(&model, "art-bad");
    p.stage_artifact(
        v1.id,
        source(&rt, &store, &u1, d1, None).unwrap(),
        &ExecOptions::default(),
    )
    .unwrap();
    p.apply(v1.id).unwrap();

    // The recorded manifest digest is checked.
    let e = source(&rt, &store, &u2, Digest::of(b"other"), Some(v1.id)).unwrap_err();
    assert!(
        matches!(e, mx_artifact::Error::ManifestDigest { .. }),
        "{e}"
    );

    // A delta whose base the worker does not hold: refused naming both ids.
    let s2 = source(&rt, &store, &u2, d2, Some(v1.id)).unwrap();
    let mut fresh = puller(&model, "art-nobase");
    let e = fresh
        .stage_artifact(v2.id, Arc::clone(&s2), &ExecOptions::default())
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::WrongBase { .. }), "{msg}");
    assert!(
        msg.contains(&v1.id.to_string()) && msg.contains(&v2.id.to_string()),
        "{msg}"
    );
    assert!(fresh.versions().staged.is_none());

    // A flipped byte in a delta object: the chunk's digest names it; nothing staged or applied.
    use object_store::ObjectStoreExt as _;
    let obj = u2.key("delta-00000.bin");
    let mut bytes = rt
        .block_on(async { store.object_store().get(&obj).await?.bytes().await })
        .unwrap()
        .to_vec();
    let good = bytes.clone();
    bytes[100] ^= 1;
    rt.block_on(store.object_store().put(&obj, bytes.into()))
        .unwrap();
    let e = p
        .stage_artifact(v2.id, Arc::clone(&s2), &ExecOptions::default())
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("chunk") && msg.contains("delta-00000.bin") && msg.contains("blake3"),
        "{msg}"
    );
    assert!(p.versions().staged.is_none());
    assert_eq!(p.versions().resident, Some(v1.id.into()));
    assert!(live(&p) == want1);

    // The object gone: named as missing.
    rt.block_on(store.object_store().delete(&obj)).unwrap();
    let e = p
        .stage_artifact(v2.id, Arc::clone(&s2), &ExecOptions::default())
        .unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");
    assert!(live(&p) == want1);

    // Put back: the same source stages and applies v2.
    rt.block_on(store.object_store().put(&obj, good.into()))
        .unwrap();
    p.stage_artifact(v2.id, s2, &ExecOptions::default())
        .unwrap();
    p.apply(v2.id).unwrap();
    let want2: Vec<Vec<u8>> = dest.iter().map(|rl| v2.reference(rl)).collect();
    assert!(live(&p) == want2);
}

#[test]
fn an_object_store_that_never_answers_times_out() {
    if !ready("an_object_store_that_never_answers_times_out") {
        return;
    }
    // Accepts connections and never answers.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", l.local_addr().unwrap());
    let held = std::thread::spawn(move || {
        let mut conns = Vec::new();
        for c in l.incoming().take(8) {
            conns.push(c);
        }
        std::thread::sleep(Duration::from_secs(30));
    });
    let url: ArtifactUrl = "s3://mx-hang/v1".parse().unwrap();
    let vars = vec![
        ("AWS_ENDPOINT_URL".to_string(), endpoint),
        ("AWS_REGION".into(), "us-east-1".into()),
        ("AWS_ACCESS_KEY_ID".into(), "k".into()),
        ("AWS_SECRET_ACCESS_KEY".into(), "s".into()),
        ("AWS_ALLOW_HTTP".into(), "true".into()),
    ];
    let opts = StoreOptions {
        timeout: Duration::from_secs(1),
        retries: 0,
        concurrency: 4,
    };
    let store = Store::from_vars(&url, opts, vars).unwrap();
    let rt = rt();
    let t = Instant::now();
    let e = rt
        .block_on(Chain::resolve(
            &store,
            &url,
            None,
            None,
            DEFAULT_CHAIN_LIMIT,
        ))
        .unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    let msg = e.to_string();
    assert!(msg.contains("s3://mx-hang/v1/mx-artifact.json"), "{msg}");
    drop(held);
}
