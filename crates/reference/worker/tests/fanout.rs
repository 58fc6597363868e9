//! Bounded fan-out against a real control plane (in process, on loopback) and real fsdp:2
//! publishers of SmolLM2-135M over NIXL: a puller holding tp:3 rank 0 asks `GetVersion` for
//! only what its plan reads, receives exactly the shards that overlap its boxes and the pieces
//! cut for it (a fraction of the whole record's bytes), checks them against the version id with
//! the answer's Merkle proof, stages and applies them byte-identical to the checkpoint; a
//! forged shard digest, a forged proof hash, a shard dropped from the answer and a shard left
//! out of a consistent answer are each refused naming what is wrong. Passes with a message
//! when NIXL or `.mx/models/smollm2-135m` is missing (`MX_REQUIRE_NIXL=1` turns a missing NIXL
//! into a failure).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: panics are failures"
)]

use crate::trainer;

use std::path::Path;
use std::time::Duration;

use crate::common::{control_plane, disk_reference, model_dir, tp3};
use mx_checkpoint::Checkpoint;
use mx_control::client::ControlClient;
use mx_control::VersionState;
use mx_layout::merkle::LeafTree;
use mx_layout::{Digest, LayoutSpec, ShardEntry, SourceManifest, TensorBox, VersionId};
use mx_nixl::Agent;
use mx_puller::{DestTensor, ExecOptions, Puller, PullerConfig};

const WAIT: Duration = Duration::from_secs(180);

/// A puller for tp:3 rank 0 with every parameter in its own buffer.
fn rank0_puller(dir: &Path) -> Puller {
    let agent = Agent::new(&format!("fanout-{}", std::process::id())).unwrap();
    let mut p = Puller::new(
        PullerConfig {
            model: trainer::model(dir),
            layout: tp3(),
            ranks: vec![0],
            retain: false,
        },
        Some(agent),
    )
    .unwrap();
    let layouts = p.rank_layouts().to_vec();
    for rl in &layouts {
        for param in &rl.params {
            p.register_param(
                rl.rank,
                &param.name,
                DestTensor {
                    dtype: param.dtype,
                    shape: param.shape.clone(),
                    memory: Box::new(vec![0u8; param.len as usize]),
                },
            )
            .unwrap();
        }
    }
    p
}

/// (slot, tensor, box) of every shard, in answer order.
fn shard_keys(ms: &[SourceManifest]) -> Vec<(u32, String, TensorBox)> {
    ms.iter()
        .flat_map(|m| {
            m.shards
                .iter()
                .map(move |s| (m.slot, s.tensor.clone(), s.shard.clone()))
        })
        .collect()
}

fn pieces(ms: &[SourceManifest]) -> usize {
    ms.iter().map(|m| m.pieces.len()).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tp3_rank_gets_only_its_shards_proven_and_forged_or_missing_ones_are_refused() {
    if !mx_nixl::nixl_or_skip("fanout") {
        return;
    }
    let Some(dir) = model_dir("fanout") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (control, server) = control_plane(tmp.path(), "127.0.0.1:0").await;
    let client = ControlClient::connect(&control).await.unwrap();
    // Registered before the trainers start, so they cut pieces for tp:3.
    client
        .register_worker("w0", "w0", &[0], tp3())
        .await
        .unwrap();
    let fsdp2: LayoutSpec = "fsdp:2".parse().unwrap();
    let mut pubs = Vec::new();
    for rank in 0..2 {
        pubs.push(trainer::start(&control, &dir, fsdp2, rank).await);
    }
    let specs = Checkpoint::open(&dir).unwrap().specs();
    client
        .declare_version("step-1", fsdp2, &specs)
        .await
        .unwrap();
    trainer::publish_all(&mut pubs, "step-1", false).await;
    let v1 = VersionId(
        client
            .wait_version("step-1", VersionState::Ready, WAIT)
            .await
            .unwrap()
            .version_digest
            .unwrap(),
    );
    let mut puller = rank0_puller(&dir);
    let want = puller.want();

    // The whole record (a caller without a want) and the fanned-out answer.
    let full = client.get_version("step-1").await.unwrap();
    assert!(full.proof.is_none(), "a whole record needs no proof");
    let fan = client.get_version_for("step-1", &want).await.unwrap();
    let proof = fan
        .proof
        .clone()
        .expect("a READY version's answer is proven");

    // Exactly the shards overlapping rank 0's boxes, in the record's order.
    let expected: Vec<_> = full
        .manifests
        .iter()
        .flat_map(|m| {
            m.shards
                .iter()
                .filter(|s| want.wants_shard(s))
                .map(move |s| (m.slot, s.tensor.clone(), s.shard.clone()))
        })
        .collect();
    let got = shard_keys(&fan.manifests);
    let all = shard_keys(&full.manifests).len();
    assert_eq!(got, expected);
    assert!(got.len() < all, "{} of {all} shards sent", got.len());
    assert_eq!(proof.positions.len(), got.len());
    assert_eq!(proof.leaf_count, all as u64);
    // Only the pieces cut for tp:3 rank 0.
    for m in &fan.manifests {
        for p in &m.pieces {
            assert_eq!((p.layout, p.dest_rank), (tp3(), 0), "{}", p.tensor);
        }
    }
    let rank0_pieces = full
        .manifests
        .iter()
        .flat_map(|m| &m.pieces)
        .filter(|p| p.layout == tp3() && p.dest_rank == 0)
        .count();
    assert_eq!(pieces(&fan.manifests), rank0_pieces);
    assert!(rank0_pieces > 0 && rank0_pieces < pieces(&full.manifests));
    // Rank 0 of tp:3 holds a box of every tensor: every declared tensor is named.
    assert_eq!(fan.tensors.len(), full.tensors.len());
    let full_bytes = mx_control::wire::version_info_to_wire(&full).len();
    let fan_bytes = mx_control::wire::version_info_to_wire(&fan).len();
    eprintln!(
        "GetVersion of SmolLM2-135M on fsdp:2 for tp:3 rank 0: {fan_bytes} bytes against \
         {full_bytes} for the whole record ({:.1}%); shards {}/{all}, pieces {}/{}, proof {} \
         hashes",
        100.0 * fan_bytes as f64 / full_bytes as f64,
        got.len(),
        rank0_pieces,
        pieces(&full.manifests),
        proof.nodes.len()
    );
    assert!(fan_bytes < full_bytes);
    let opts = ExecOptions::default();

    // A shard whose digest was forged is named.
    let mut forged = fan.manifests.clone();
    forged[1].shards[3].digest = Digest([7; 32]);
    let e = puller.stage_proven(v1, &forged, &proof, &opts).unwrap_err();
    let tensor = &forged[1].shards[3].tensor;
    assert!(
        matches!(&e, mx_puller::Error::Unproven { source, .. } if matches!(
            source.as_ref(),
            mx_layout::Error::ShardNotInVersion { tensor: t, slot, .. }
                if t == tensor && *slot == forged[1].slot
        )),
        "{e}"
    );
    assert!(e.to_string().contains(tensor.as_str()), "{e}");

    // A forged hash in the proof misses the version id.
    let mut bad = proof.clone();
    let last = bad.nodes.len() - 1;
    bad.nodes[last][5] ^= 0x40;
    let e = puller
        .stage_proven(v1, &fan.manifests, &bad, &opts)
        .unwrap_err();
    assert!(
        matches!(&e, mx_puller::Error::Unproven { source, .. }
            if matches!(source.as_ref(), mx_layout::Error::ProofRoot { .. })),
        "{e}"
    );
    assert!(e.to_string().contains(&v1.to_string()), "{e}");

    // A shard dropped from the answer (its position kept) is refused.
    let mut dropped = fan.manifests.clone();
    let gone = dropped[0].shards.remove(0);
    let e = puller
        .stage_proven(v1, &dropped, &proof, &opts)
        .unwrap_err();
    assert!(matches!(e, mx_puller::Error::Unproven { .. }), "{e}");

    // A consistent answer that leaves a needed shard out (re-proven without it) is refused
    // naming the parameter it leaves uncovered.
    let record: Vec<&ShardEntry> = full.manifests.iter().flat_map(|m| &m.shards).collect();
    let (tree, _) = LeafTree::new(&record).unwrap();
    assert_eq!(VersionId(tree.root()), v1);
    let short = tree.prove(proof.positions[1..].to_vec()).unwrap();
    let e = puller
        .stage_proven(v1, &dropped, &short, &opts)
        .unwrap_err();
    assert!(
        matches!(&e, mx_puller::Error::Incomplete { .. }),
        "{} left out: {e}",
        gone.tensor
    );
    assert!(e.to_string().contains(&gone.tensor), "{e}");
    assert_eq!(
        puller.versions().staged,
        None,
        "a refused answer staged nothing"
    );

    // The genuine answer stages and applies byte-identical to the checkpoint's slices.
    let r = puller
        .stage_proven(v1, &fan.manifests, &proof, &opts)
        .unwrap();
    assert!(r.useful_bytes > 0, "{r:?}");
    puller.apply(v1).unwrap();
    let disk = disk_reference(&dir).await;
    let rank0: Vec<_> = disk.into_iter().filter(|d| d.rank == 0).collect();
    assert_eq!(puller.live_digests().unwrap(), rank0);
    server.shutdown().await.unwrap();
}
