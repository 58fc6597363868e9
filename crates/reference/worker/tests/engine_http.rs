//! The worker's HTTP engine routes on loopback with the real SmolLM2-135M: disk loads, greedy
//! generation with the live weights, cache clearing, failpoints, pause modes, and the Dynamo and
//! SGLang contracts as mx-adapters' clients speak them. No NIXL needed. Each test passes with a
//! message when `.mx/models/smollm2-135m` is missing.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: panics are failures"
)]

use std::time::{Duration, Instant};

use crate::common::{
    generate, get, ids, load, model_dir, paused_update, post, serve, PARIS, PROMPT,
};
use mx_adapters::dynamo::{DynamoClient, DynamoWorkerClient};
use mx_adapters::dynamo_sglang::DynamoSglangClient;
use mx_adapters::PauseMode as DynPause;
use mx_adapters::{EngineClient, SglangPause};
use mx_worker::ResidentVersion;
use serde_json::json;

const T: Duration = Duration::from_secs(120);

/// Waits until `n` generation requests are in flight on `inst`.
async fn until_in_flight(inst: &mx_worker::Instance, n: u64) {
    let t = Instant::now();
    while inst.requests_in_flight() != n {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{n} requests never in flight"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_load_generates_paris_on_tp3_and_every_apply_clears_the_caches() {
    let Some(dir) = model_dir("disk_load_generates_paris") else {
        return;
    };
    let (inst, http) = serve(&dir, &[0, 1, 2], false).await;
    let base = http.url();
    let dynamo = DynamoWorkerClient::new(&base, T);

    // No weights yet: generation is 503, the worker reports no version (null).
    let (status, body) = generate(&base, &PROMPT, 2).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no weights"),
        "{body}"
    );
    assert!(matches!(
        dynamo.get_weight_version().await,
        Err(mx_adapters::Error::NoVersion { .. })
    ));
    let (status, raw) = post(&format!("{base}/engine/get_weight_version"), json!({})).await;
    assert_eq!(status, 200, "{raw}");
    assert_eq!(
        raw,
        json!({"status": "ok", "message": "no weights resident", "version_declared": false})
    );
    let (status, body) = get(&format!("{base}/mx/live_digests")).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("no weights"),
        "{body}"
    );

    // Discovery lists this worker with every route the refit needs.
    let d = DynamoClient::new(&base, T).discover().await.unwrap();
    assert_eq!(d.namespace, "dynamo");
    assert_eq!(d.workers.len(), 1);
    assert!(d.left_out.is_empty());
    let w = &d.workers[0];
    assert_eq!(w.system_url.as_deref(), Some(base.as_str()));
    assert_eq!(
        (
            w.component.as_str(),
            w.endpoint.as_str(),
            w.transport.as_str()
        ),
        ("worker", "generate", "http")
    );
    assert_eq!(w.world_size, Some(3));
    assert_eq!(w.model.as_deref(), Some("smollm2-135m"));
    let (_, raw) = get(&format!("{base}/v1/rl/workers")).await;
    assert_eq!(raw["protocol_version"], 1);
    assert!(raw["workers"][0]["instance_id"].is_u64(), "{raw}");
    assert_eq!(
        raw["workers"][0]["routes"],
        json!([
            "get_weight_version",
            "pause_generation",
            "resume_generation",
            "update_weights_from_disk",
            "update_weights_from_distributed"
        ])
    );

    // Disk load through the Dynamo contract: refused unless paused (HTTP 200, status error).
    let path = dir.to_str().unwrap();
    match dynamo.update_weights_from_disk(path, "v1").await {
        Err(mx_adapters::Error::Engine { message, .. }) => {
            assert!(message.contains("must be paused"), "{message}")
        }
        other => panic!("an update without a pause: {other:?}"),
    }
    assert_eq!(inst.resident_version(), None);
    let r = load(&dynamo, path, "v1").await.unwrap();
    assert_eq!(r.version.as_deref(), Some("v1"));
    assert_eq!(r.cache_tiers_cleared, ["kv_cache", "prefix_cache"]);
    assert_eq!(dynamo.get_weight_version().await.unwrap(), "v1");
    assert_eq!(inst.cached_positions(), Some(0));

    let (status, body) = generate(&base, &PROMPT, 2).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(ids(&body), PARIS, "{body}");
    let meta = &body["meta_info"];
    assert_eq!(meta["weight_version"], "v1");
    assert_eq!(meta["prompt_tokens"], 5);
    assert_eq!(meta["completion_tokens"], 2);
    assert_eq!(meta["cached_tokens"], 0);
    assert_eq!(
        meta["finish_reason"],
        json!({"type": "length", "length": 2})
    );
    assert!(
        inst.cached_positions().unwrap() > 0,
        "the decode filled the KV cache"
    );

    // The same prompt again is served from the prefix cache.
    let (_, body) = generate(&base, &PROMPT, 2).await;
    assert_eq!(ids(&body), PARIS);
    assert_eq!(body["meta_info"]["cached_tokens"], 5, "{body}");

    // A second disk load (no weight_version: the id is disk:<path>) clears every tier; the old
    // live version is pinned.
    let (status, raw) = paused_update(
        &base,
        "update_weights_from_disk",
        json!({"model_path": path, "weight_version": ""}),
    )
    .await;
    assert_eq!(status, 200, "{raw}");
    assert_eq!(raw["status"], "ok");
    assert_eq!(raw["version"], format!("disk:{path}"));
    assert_eq!(
        raw["cache_tiers_cleared"],
        json!(["kv_cache", "prefix_cache"])
    );
    assert!(raw["apply_seconds"].as_f64().unwrap() > 0.0, "{raw}");
    assert_eq!(
        inst.cached_positions(),
        Some(0),
        "apply must clear the KV cache"
    );
    assert_eq!(inst.versions().pinned, Some(ResidentVersion::parse("v1")));
    let (_, body) = generate(&base, &PROMPT, 2).await;
    assert_eq!(ids(&body), PARIS);
    assert_eq!(
        body["meta_info"]["cached_tokens"], 0,
        "the prefix cache was cleared: {body}"
    );

    // Requests are checked field by field; no failpoints route without --failpoints.
    let (status, raw) = post(
        &format!("{base}/generate"),
        json!({"input_ids": PROMPT, "sampling_params": {"temperature": 0.8}}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(raw["error"]["message"]
        .as_str()
        .unwrap()
        .contains("sampling_params.temperature"));
    let (status, _) = generate(&base, &[49152], 1).await;
    assert_eq!(
        status, 400,
        "a token outside the vocabulary is a bad request"
    );
    let (status, _) = get(&format!("{base}/mx/failpoints")).await;
    assert_eq!(status, 404);
    http.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failpoints_lie_about_the_cache_fail_generation_and_hang_apply() {
    let Some(dir) = model_dir("failpoints") else {
        return;
    };
    let (inst, http) = serve(&dir, &[0, 1, 2], true).await;
    let base = http.url();
    let fp = format!("{base}/mx/failpoints");
    let path = dir.to_str().unwrap();
    let dynamo = DynamoWorkerClient::new(&base, T);
    load(&dynamo, path, "v1").await.unwrap();
    let (_, body) = generate(&base, &PROMPT, 2).await;
    assert_eq!(ids(&body), PARIS);
    let cached = inst.cached_positions().unwrap();
    assert!(cached > 0);

    // apply.skip_cache_clear: weights installed, caches kept, tiers still reported cleared.
    let (status, raw) = post(&fp, json!({"apply.skip_cache_clear": true})).await;
    assert_eq!(status, 200, "{raw}");
    assert_eq!(get(&fp).await.1["apply.skip_cache_clear"], true);
    let r = load(&dynamo, path, "v2").await.unwrap();
    assert_eq!(r.version.as_deref(), Some("v2"));
    assert_eq!(
        r.cache_tiers_cleared,
        ["kv_cache", "prefix_cache"],
        "the lie"
    );
    assert_eq!(
        inst.cached_positions(),
        Some(cached),
        "the caches survived the apply"
    );
    let (_, body) = generate(&base, &PROMPT, 2).await;
    assert_eq!(
        body["meta_info"]["cached_tokens"], 5,
        "stale prefix reused: {body}"
    );

    // generate.fail: HTTP 500.
    post(
        &fp,
        json!({"apply.skip_cache_clear": null, "generate.fail": true}),
    )
    .await;
    let (status, body) = generate(&base, &PROMPT, 2).await;
    assert_eq!(status, 500, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("generate.fail"));

    // apply.sleep_ms: the next apply takes at least that long (the failpoint then clears itself;
    // a client with a shorter deadline sees a hung worker).
    post(&fp, json!({"generate.fail": null, "apply.sleep_ms": 400})).await;
    assert_eq!(get(&fp).await.1["apply.sleep_ms"], 400);
    let short = DynamoWorkerClient::new(&base, Duration::from_millis(100));
    dynamo.pause(DynPause::Keep, false).await.unwrap();
    let e = short
        .update_weights_from_disk(path, "v3")
        .await
        .unwrap_err();
    assert!(matches!(e, mx_adapters::Error::Timeout { .. }), "{e}");
    // The hung apply still completes; the next one does not sleep.
    let t = Instant::now();
    while inst.resident_version() != Some(ResidentVersion::parse("v3")) {
        assert!(t.elapsed() < T, "the hung apply never completed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(t.elapsed() >= Duration::from_millis(250));
    dynamo.resume().await.unwrap();
    let listed = get(&fp).await.1;
    assert_eq!(listed["apply.sleep_ms"], serde_json::Value::Null);
    assert_eq!(listed["generate.fail"], serde_json::Value::Null);
    load(&dynamo, path, "v4").await.unwrap();
    assert_eq!(inst.cached_positions(), Some(0), "caches cleared again");

    // Unknown names and wrong types are refused, naming them; nothing changes.
    post(&fp, json!({"stage.sleep_between_sources_ms": 300})).await;
    let (status, raw) = post(
        &fp,
        json!({"stage.sleep_between_sources_ms": null, "no.such": true}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        raw["message"].as_str().unwrap().contains("no.such"),
        "{raw}"
    );
    assert_eq!(get(&fp).await.1["stage.sleep_between_sources_ms"], 300);
    http.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pause_modes_abort_hold_and_wait_for_requests() {
    let Some(dir) = model_dir("pause_modes") else {
        return;
    };
    let (inst, http) = serve(&dir, &[0, 1, 2], false).await;
    let base = http.url();
    let dynamo = DynamoWorkerClient::new(&base, T);
    load(&dynamo, dir.to_str().unwrap(), "v1").await.unwrap();
    const N: usize = 64;
    let (_, body) = generate(&base, &PROMPT, N).await;
    let full = ids(&body);
    assert_eq!(
        full.len(),
        N,
        "the end-of-sequence token is not a default stop"
    );
    assert_eq!(full[..2], PARIS);
    // SmolLM2 ends its answer with its end-of-sequence token (id 2): with it as a stop token the
    // output ends there.
    let eos = full
        .iter()
        .position(|&t| t == 2)
        .expect("an end-of-sequence token")
        + 1;
    let (_, stopped) = post(
        &format!("{base}/generate"),
        json!({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": N, "stop_token_ids": [2]}}),
    )
    .await;
    assert_eq!(ids(&stopped), full[..eos], "{stopped}");
    assert_eq!(
        stopped["meta_info"]["finish_reason"],
        json!({"type": "stop", "matched": 2})
    );

    // abort: new requests are refused with 503 "generation paused".
    dynamo.pause(DynPause::Abort, false).await.unwrap();
    let (status, body) = generate(&base, &PROMPT, 2).await;
    assert_eq!(status, 503);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("generation paused"));
    dynamo.resume().await.unwrap();

    // keep with a request in flight: it holds between tokens (the pause returns once it does)
    // and continues after resume with the same tokens.
    let b = base.clone();
    let inflight = tokio::spawn(async move { generate(&b, &PROMPT, N).await });
    until_in_flight(&inst, 1).await;
    // Let it decode a few tokens first (the whole answer takes well over a second here).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = dynamo.pause(DynPause::Keep, false).await.unwrap();
    assert!(
        r.message
            .contains("(mode keep): 1 request(s) were in flight, 1 held"),
        "{}",
        r.message
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !inflight.is_finished(),
        "a held request finished while paused"
    );
    dynamo.resume().await.unwrap();
    let (status, body) = inflight.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        ids(&body),
        full,
        "the held request continued where it stopped"
    );

    // keep: a new request waits while paused and runs after resume.
    let r = dynamo.pause(DynPause::Keep, false).await.unwrap();
    assert!(r.message.contains("keep"), "{}", r.message);
    let b = base.clone();
    let waiting = tokio::spawn(async move { generate(&b, &PROMPT, N).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "a request ran while paused with keep"
    );
    dynamo.resume().await.unwrap();
    let (status, body) = waiting.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(ids(&body), full);

    // wait: the pause returns only after the request in flight finished.
    let b = base.clone();
    let running = tokio::spawn(async move { generate(&b, &[1, 2, 3, 4, 5, 6, 7], N).await });
    until_in_flight(&inst, 1).await;
    let r = dynamo.pause(DynPause::Wait, true).await.unwrap();
    // The pause saw the request in flight and returned only once nothing ran (it was not held).
    assert!(
        r.message
            .contains("(mode wait): 1 request(s) were in flight, 0 held"),
        "{}",
        r.message
    );
    assert_eq!(
        running.await.unwrap().0,
        200,
        "the request finished, not aborted"
    );
    assert_eq!(
        inst.cached_positions(),
        Some(0),
        "pause with clear_cache clears the caches"
    );
    dynamo.resume().await.unwrap();
    assert!(inst.paused().is_none());

    // abort with a request in flight: it stops between tokens with 503.
    let b = base.clone();
    let inflight = tokio::spawn(async move { generate(&b, &[9, 8, 7, 6, 5], N).await });
    until_in_flight(&inst, 1).await;
    let r = dynamo.pause(DynPause::Abort, false).await.unwrap();
    assert!(
        r.message
            .contains("(mode abort): 1 request(s) were in flight, 0 held"),
        "{}",
        r.message
    );
    let (status, body) = inflight.await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("aborted by pause_generation"),
        "{body}"
    );
    dynamo.resume().await.unwrap();
    http.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamo_sglang_contract_updates_pauses_and_continues() {
    let Some(dir) = model_dir("sglang_contract") else {
        return;
    };
    let (inst, http) = serve(&dir, &[0, 1, 2], false).await;
    let base = http.url();
    let sg = DynamoSglangClient::new(&base, T).with_tp_size(3);
    let path = dir.to_str().unwrap();

    // update_weights_from_disk: success, no paused requests, not left paused.
    let u = sg
        .update_weights_from_disk(path, "s1", true, false)
        .await
        .unwrap();
    assert_eq!(u.num_paused_requests, 0);
    assert!(
        inst.paused().is_none(),
        "keep_pause false leaves generation running"
    );
    let (status, body) = generate(&base, &PROMPT, 2).await;
    assert_eq!((status, ids(&body)), (200, PARIS.to_vec()));
    assert_eq!(body["meta_info"]["weight_version"], "s1");

    // The raw answer carries cache_tiers_cleared; flush_cache false clears nothing.
    let (status, raw) = post(
        &format!("{base}/engine/control/update_weights_from_disk"),
        json!({"model_path": path, "weight_version": "s2", "flush_cache": false, "keep_pause": true}),
    )
    .await;
    assert_eq!(status, 200, "{raw}");
    assert_eq!(raw["success"], true);
    assert_eq!(raw["cache_tiers_cleared"], json!([]));
    assert_eq!(raw["num_paused_requests"], 0);
    assert!(
        inst.paused().is_some(),
        "keep_pause true keeps generation paused"
    );
    sg.continue_generation(true).await.unwrap();
    assert!(inst.paused().is_none());

    // pause_generation with abort refuses new requests until continue_generation.
    sg.pause_generation(SglangPause::Abort).await.unwrap();
    let (status, _) = generate(&base, &PROMPT, 2).await;
    assert_eq!(status, 503);
    sg.continue_generation(false).await.unwrap();
    let (status, _) = generate(&base, &PROMPT, 2).await;
    assert_eq!(status, 200);

    // Failures: HTTP 200 and success false (Dynamo's SGLang routes answer failures in the
    // body), naming what is wrong; nothing changes.
    let e = sg
        .update_weights_from_disk("/no/such/checkpoint", "x", true, false)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("/no/such/checkpoint"), "{e}");
    let (status, raw) = post(
        &format!("{base}/engine/control/update_weights_from_disk"),
        json!({"model_path": format!("mx://{}", "0".repeat(64))}),
    )
    .await;
    assert_eq!(status, 200, "{raw}");
    assert_eq!(raw["success"], false);
    let msg = raw["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("mx:{}", "0".repeat(64))) && msg.contains("resident: s2"),
        "{msg}"
    );
    assert_eq!(inst.resident_version(), Some(ResidentVersion::parse("s2")));

    // update_weights_from_tensor with mx's loader, inside a weight-update session: each held
    // rank reads its own marker.
    let tensor_url = format!("{base}/engine/control/update_weights_from_tensor");
    let disk = format!("disk:{path}");
    let body = mx_adapters::sglang::tensor_update(&disk, 3, true).unwrap();
    let (status, raw) = post(&tensor_url, serde_json::to_value(&body).unwrap()).await;
    assert_eq!(
        (status, raw["success"].clone()),
        (200, json!(false)),
        "{raw}"
    );
    assert!(raw["message"]
        .as_str()
        .unwrap()
        .contains("between begin_weight_update"));
    let e = sg.end_weight_update().await.unwrap_err();
    assert!(
        e.to_string().contains("no weight-update session is open"),
        "{e}"
    );
    sg.begin_weight_update().await.unwrap();
    let e = sg.begin_weight_update().await.unwrap_err();
    assert!(e.to_string().contains("already open"), "{e}");
    let (status, raw) = post(&tensor_url, serde_json::to_value(&body).unwrap()).await;
    assert_eq!(
        (status, &raw),
        (200, &json!({"success": true, "message": "Success"}))
    );
    assert_eq!(inst.resident_version(), Some(ResidentVersion::parse(&disk)));
    assert!(
        inst.paused().is_none(),
        "the update paused and resumed itself"
    );
    // An install that fails still answers success (SGLang's contract with a custom loader: the
    // rank reports the failure to the control plane); nothing changes.
    let unknown = format!("mx:{}", "0".repeat(64));
    let body = mx_adapters::sglang::tensor_update(&unknown, 3, true).unwrap();
    let (status, raw) = post(&tensor_url, serde_json::to_value(&body).unwrap()).await;
    assert_eq!(
        (status, raw["success"].clone()),
        (200, json!(true)),
        "{raw}"
    );
    assert_eq!(inst.resident_version(), Some(ResidentVersion::parse(&disk)));
    // What mx's loader cannot read is refused, naming the field: a rank without its element,
    // ranks naming different versions, another loader, a body that is no marker.
    let one = mx_adapters::sglang::tensor_update(&disk, 1, true).unwrap();
    let mut mixed = mx_adapters::sglang::tensor_update(&disk, 3, true).unwrap();
    mixed.serialized_named_tensors[2] = mx_adapters::sglang::marker("s9").unwrap();
    let mut other = mx_adapters::sglang::tensor_update(&disk, 3, true).unwrap();
    other.load_format = Some("direct".into());
    let mut garbage = mx_adapters::sglang::tensor_update(&disk, 3, true).unwrap();
    garbage.serialized_named_tensors[0] = "gARdcQAu".into();
    for (body, field) in [
        (one, "serialized_named_tensors[1]"),
        (mixed, "serialized_named_tensors[2]"),
        (other, "load_format"),
        (garbage, "serialized_named_tensors[0]"),
    ] {
        let (status, raw) = post(&tensor_url, serde_json::to_value(&body).unwrap()).await;
        assert_eq!(
            (status, raw["success"].clone()),
            (200, json!(false)),
            "{raw}"
        );
        assert!(raw["message"].as_str().unwrap().contains(field), "{raw}");
    }
    assert_eq!(inst.resident_version(), Some(ResidentVersion::parse(&disk)));
    sg.end_weight_update().await.unwrap();
    // The client's apply runs the whole session (answered success, the rank holding what it
    // held: its report would say so); it has no read-back of its own.
    let a = sg
        .apply(&ResidentVersion::parse("disk:/no/such/dir"))
        .await
        .unwrap();
    assert_eq!(a.version, None);
    assert_eq!(inst.resident_version(), Some(ResidentVersion::parse(&disk)));
    sg.apply(&ResidentVersion::parse("disk:/no/such/dir"))
        .await
        .unwrap();
    assert!(sg.read_version().await.unwrap().version.is_none());
    http.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_without_every_rank_loads_but_refuses_generation_with_409() {
    let Some(dir) = model_dir("partial_ranks") else {
        return;
    };
    let (inst, http) = serve(&dir, &[1], false).await;
    let base = http.url();
    let dynamo = DynamoWorkerClient::new(&base, T);
    let r = load(&dynamo, dir.to_str().unwrap(), "v1").await.unwrap();
    assert!(
        r.cache_tiers_cleared.is_empty(),
        "no engine: no cache tier to clear, none reported: {:?}",
        r.cache_tiers_cleared
    );
    assert_eq!(inst.resident_version(), Some(ResidentVersion::parse("v1")));
    let (status, body) = generate(&base, &PROMPT, 2).await;
    assert_eq!(status, 409, "{body}");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("[1]") && msg.contains("tp:3"), "{msg}");

    // Byte-exact: the rank's live bytes equal a full-rank instance's rank 1 loaded from disk.
    let (full, full_http) = serve(&dir, &[0, 1, 2], false).await;
    full.apply(mx_worker::ApplySource::Disk {
        path: dir.clone(),
        version: "v1".into(),
    })
    .await
    .unwrap();
    let (_, one) = inst.live_digests().await.unwrap().unwrap();
    let (_, all) = full.live_digests().await.unwrap().unwrap();
    assert_eq!(one[0], all[1]);
    // GET /mx/live_digests reports the same, for the one rank held.
    let (status, live) = get(&format!("{base}/mx/live_digests")).await;
    assert_eq!(status, 200, "{live}");
    assert_eq!(live["version"], "v1");
    assert_eq!(live["ranks"].as_array().unwrap().len(), 1);
    assert_eq!(live["ranks"][0]["rank"], 1);
    let tensors = live["ranks"][0]["tensors"].as_object().unwrap();
    assert_eq!(tensors.len(), all[1].tensors.len());
    for (name, d) in &all[1].tensors {
        assert_eq!(tensors[name], d.to_string(), "{name}");
    }
    http.shutdown().await;
    full_http.shutdown().await;
}
