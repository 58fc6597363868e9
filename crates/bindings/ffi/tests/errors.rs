//! The C ABI's error paths, called from Rust as C would call them: NULL handles, strings and
//! output pointers, strings that are not UTF-8, bad dtypes and layouts, too many dims, and
//! bad registrations each return their status with a last error naming the culprit; a
//! failed create writes no handle; the `*_free` functions take NULL; the last error is
//! per thread and cleared by a successful call. None of these needs NIXL or a control plane
//! except where a test says so (it then passes with a message when NIXL is missing, unless
//! `MX_REQUIRE_NIXL=1`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::undocumented_unsafe_blocks,
    reason = "tests: panics are failures; every unsafe call passes pointers to live locals"
)]

use std::ffi::{c_char, CStr, CString};
use std::ptr::{null, null_mut};

use mx::*;

fn last_error() -> String {
    unsafe { CStr::from_ptr(mx_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[track_caller]
fn refused(status: Status, want: Status, needles: &[&str]) -> String {
    let e = last_error();
    assert_eq!(
        status,
        want,
        "got {:?}, wanted {:?}: {e}",
        unsafe { CStr::from_ptr(mx_status_name(status)) },
        unsafe { CStr::from_ptr(mx_status_name(want)) }
    );
    for n in needles {
        assert!(e.contains(n), "{n:?} not in {e:?}");
    }
    e
}

const CONFIG: &str = r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,
"num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,
"vocab_size":256,"tie_word_embeddings":true}"#;

/// The tensors of CONFIG's model: (name, shape).
fn tensors() -> Vec<(String, Vec<u64>)> {
    let l = "model.layers.0";
    vec![
        ("model.embed_tokens.weight".into(), vec![256, 64]),
        ("model.norm.weight".into(), vec![64]),
        (format!("{l}.self_attn.q_proj.weight"), vec![64, 64]),
        (format!("{l}.self_attn.k_proj.weight"), vec![32, 64]),
        (format!("{l}.self_attn.v_proj.weight"), vec![32, 64]),
        (format!("{l}.self_attn.o_proj.weight"), vec![64, 64]),
        (format!("{l}.mlp.gate_proj.weight"), vec![128, 64]),
        (format!("{l}.mlp.up_proj.weight"), vec![128, 64]),
        (format!("{l}.mlp.down_proj.weight"), vec![64, 128]),
        (format!("{l}.input_layernorm.weight"), vec![64]),
        (format!("{l}.post_attention_layernorm.weight"), vec![64]),
    ]
}

/// Makes the model through the C ABI, with `dtype` for every tensor.
fn model_with(dtype: &str) -> (Status, *mut Model) {
    let ts = tensors();
    let names: Vec<CString> = ts
        .iter()
        .map(|(n, _)| CString::new(n.as_str()).unwrap())
        .collect();
    let dt = CString::new(dtype).unwrap();
    let specs: Vec<TensorSpecC> = ts
        .iter()
        .zip(&names)
        .map(|((_, shape), n)| TensorSpecC {
            name: n.as_ptr(),
            dtype: dt.as_ptr(),
            shape: shape.as_ptr(),
            ndim: shape.len(),
        })
        .collect();
    let config = CString::new(CONFIG).unwrap();
    let mut m = null_mut();
    let st = unsafe { mx_model_from_config(config.as_ptr(), specs.as_ptr(), specs.len(), &mut m) };
    (st, m)
}

fn model() -> *mut Model {
    let (st, m) = model_with("BF16");
    assert_eq!(st, MX_OK, "{}", last_error());
    assert!(!m.is_null());
    m
}

#[test]
fn models_refuse_bad_input_naming_it() {
    let (st, m) = model_with("bfloat17");
    refused(
        st,
        MX_ERR_INVALID_ARGUMENT,
        &[
            "mx_model_from_config",
            "tensors[0] (model.embed_tokens.weight).dtype",
            "bfloat17",
        ],
    );
    assert!(m.is_null(), "a failed create wrote a handle");

    let mut m = null_mut();
    let st = unsafe { mx_model_from_config(null(), null(), 0, &mut m) };
    refused(st, MX_ERR_INVALID_ARGUMENT, &["config_json: NULL string"]);
    let bad_utf8 = [b'{', 0xff, b'}', 0];
    let st = unsafe { mx_model_from_config(bad_utf8.as_ptr().cast(), null(), 0, &mut m) };
    refused(st, MX_ERR_INVALID_ARGUMENT, &["config_json: not UTF-8"]);
    let config = CString::new(CONFIG).unwrap();
    let st = unsafe { mx_model_from_config(config.as_ptr(), null(), 3, &mut m) };
    refused(st, MX_ERR_INVALID_ARGUMENT, &["tensors: NULL array of 3"]);
    // A model missing the tensors config.json describes is refused by the layout rules.
    let st = unsafe { mx_model_from_config(config.as_ptr(), null(), 0, &mut m) };
    refused(st, MX_ERR_LAYOUT, &["model.embed_tokens.weight"]);
    // Too many dims.
    let name = CString::new("x").unwrap();
    let dt = CString::new("F32").unwrap();
    let shape = [1u64; 9];
    let spec = TensorSpecC {
        name: name.as_ptr(),
        dtype: dt.as_ptr(),
        shape: shape.as_ptr(),
        ndim: 9,
    };
    let st = unsafe { mx_model_from_config(config.as_ptr(), &spec, 1, &mut m) };
    refused(
        st,
        MX_ERR_INVALID_ARGUMENT,
        &["tensors[0] (x).shape: 9 dims; at most 8"],
    );
    let dir = CString::new("/nonexistent/mx-model").unwrap();
    let st = unsafe { mx_model_from_dir(dir.as_ptr(), &mut m) };
    refused(st, MX_ERR_IO, &["/nonexistent/mx-model"]);
    assert!(m.is_null());

    let good = model();
    let mut n = 0usize;
    assert_eq!(unsafe { mx_model_tensor_count(good, &mut n) }, MX_OK);
    assert_eq!(n, tensors().len());
    assert_eq!(last_error(), "", "a successful call clears the last error");
    let st = unsafe { mx_model_tensor_count(good, null_mut()) };
    refused(st, MX_ERR_INVALID_ARGUMENT, &["out: NULL output pointer"]);
    let st = unsafe { mx_model_tensor_count(null(), &mut n) };
    refused(st, MX_ERR_INVALID_ARGUMENT, &["model: NULL handle"]);
    unsafe { mx_model_free(good) };
}

#[test]
fn frees_take_null_and_statics_are_named() {
    unsafe {
        mx_model_free(null_mut());
        mx_publisher_free(null_mut());
        mx_puller_free(null_mut());
        mx_control_free(null_mut());
        mx_control_plane_free(null_mut());
        mx_string_free(null_mut());
    }
    let name = |s| {
        unsafe { CStr::from_ptr(mx_status_name(s)) }
            .to_str()
            .unwrap()
    };
    assert_eq!(name(MX_OK), "MX_OK");
    assert_eq!(name(MX_ERR_VERIFY), "MX_ERR_VERIFY");
    assert_eq!(name(MX_ERR_PANIC), "MX_ERR_PANIC");
    assert_eq!(name(-7), "MX_ERR_UNKNOWN_STATUS");
    let v = unsafe { CStr::from_ptr(mx_version()) }.to_str().unwrap();
    assert_eq!(v, env!("CARGO_PKG_VERSION"));
    let bad = CString::new("not a ( filter [").unwrap();
    refused(
        unsafe { mx_log_init(bad.as_ptr()) },
        MX_ERR_INVALID_ARGUMENT,
        &["mx_log_init", "filter"],
    );
}

#[test]
fn the_last_error_is_per_thread() {
    let st = unsafe { mx_model_tensor_count(null(), null_mut()) };
    refused(st, MX_ERR_INVALID_ARGUMENT, &["model: NULL handle"]);
    let other = std::thread::spawn(last_error).join().unwrap();
    assert_eq!(other, "", "another thread sees no error");
    assert!(last_error().contains("NULL handle"));
}

#[test]
fn null_handles_and_strings_are_refused_by_every_family() {
    let label = CString::new("v1").unwrap();
    let mut s: *mut c_char = null_mut();
    let mut id = 0u64;
    let buf = [0u8; 16];
    unsafe {
        refused(
            mx_publisher_publish(null(), label.as_ptr(), 0, 1, &mut s),
            MX_ERR_INVALID_ARGUMENT,
            &["mx_publisher_publish", "publisher: NULL handle"],
        );
        refused(
            mx_publisher_register_host(null(), buf.as_ptr().cast(), 16, &mut id),
            MX_ERR_INVALID_ARGUMENT,
            &["publisher: NULL handle"],
        );
        refused(
            mx_publisher_wait_staged(null(), label.as_ptr(), 1, null_mut()),
            MX_ERR_INVALID_ARGUMENT,
            &["publisher: NULL handle"],
        );
        refused(
            mx_puller_stage(null(), label.as_ptr(), null_mut()),
            MX_ERR_INVALID_ARGUMENT,
            &["mx_puller_stage", "puller: NULL handle"],
        );
        refused(
            mx_puller_apply(null(), null()),
            MX_ERR_INVALID_ARGUMENT,
            &["puller: NULL handle"],
        );
        refused(
            mx_puller_rollback(null()),
            MX_ERR_INVALID_ARGUMENT,
            &["puller: NULL handle"],
        );
        refused(
            mx_control_declare(null(), label.as_ptr(), label.as_ptr(), null()),
            MX_ERR_INVALID_ARGUMENT,
            &["control: NULL handle"],
        );
        let mut c = null_mut();
        refused(
            mx_control_connect(null(), &mut c),
            MX_ERR_INVALID_ARGUMENT,
            &["addr: NULL string"],
        );
        let bad = CString::new("not an address at all").unwrap();
        refused(
            mx_control_connect(bad.as_ptr(), &mut c),
            MX_ERR_INVALID_ARGUMENT,
            &["not an address at all"],
        );
        assert!(c.is_null());
        let mut plane = null_mut();
        let journal = CString::new("/tmp/unused.jsonl").unwrap();
        refused(
            mx_control_plane_start(bad.as_ptr(), journal.as_ptr(), &mut plane, null_mut()),
            MX_ERR_INVALID_ARGUMENT,
            &["listen"],
        );
        assert!(plane.is_null());
    }
}

#[test]
fn bad_publisher_arguments_are_refused_before_connecting() {
    let m = model();
    let control = CString::new("http://127.0.0.1:9").unwrap();
    let layout = CString::new("fsdp:2").unwrap();
    let mut p = null_mut();
    unsafe {
        let bad = CString::new("fsdp").unwrap();
        refused(
            mx_publisher_create(control.as_ptr(), bad.as_ptr(), 0, m, &mut p),
            MX_ERR_INVALID_ARGUMENT,
            &["layout", "fsdp"],
        );
        refused(
            mx_publisher_create(control.as_ptr(), layout.as_ptr(), 2, m, &mut p),
            MX_ERR_INVALID_ARGUMENT,
            &["slot 2 is outside trainer layout fsdp:2"],
        );
        refused(
            mx_publisher_create(null(), layout.as_ptr(), 0, m, &mut p),
            MX_ERR_INVALID_ARGUMENT,
            &["control: NULL string"],
        );
        refused(
            mx_publisher_create(control.as_ptr(), layout.as_ptr(), 0, m, null_mut()),
            MX_ERR_INVALID_ARGUMENT,
            &["out: NULL output pointer"],
        );
        assert!(p.is_null());
        mx_model_free(m);
    }
}

/// A puller without a control plane (needs NIXL for its agent): parameter queries, refused
/// registrations naming the parameter, and state errors.
#[test]
fn puller_registrations_are_checked_against_the_layout() {
    if !mx_nixl::nixl_or_skip("puller_registrations_are_checked_against_the_layout") {
        return;
    }
    let m = model();
    let layout = CString::new("tp:2").unwrap();
    let ranks = [0u32, 1];
    let mut p = null_mut();
    unsafe {
        let dup = [1u32, 1];
        refused(
            mx_puller_create(
                null(),
                null(),
                layout.as_ptr(),
                dup.as_ptr(),
                2,
                m,
                1,
                &mut p,
            ),
            MX_ERR_INVALID_ARGUMENT,
            &["ranks"],
        );
        refused(
            mx_puller_create(
                null(),
                null(),
                layout.as_ptr(),
                ranks.as_ptr(),
                2,
                m,
                3,
                &mut p,
            ),
            MX_ERR_INVALID_ARGUMENT,
            &["retain", "2 (in staging)"],
        );
        let tp3 = CString::new("tp:3").unwrap();
        refused(
            mx_puller_create(
                null(),
                null(),
                tp3.as_ptr(),
                ranks.as_ptr(),
                1,
                m,
                1,
                &mut p,
            ),
            MX_ERR_LAYOUT,
            &["tp:3"],
        );
        assert!(p.is_null());
        assert_eq!(
            mx_puller_create(
                null(),
                null(),
                layout.as_ptr(),
                ranks.as_ptr(),
                2,
                m,
                1,
                &mut p
            ),
            MX_OK,
            "{}",
            last_error()
        );
        mx_model_free(m);

        let mut n = 0usize;
        assert_eq!(mx_puller_param_count(p, 1, &mut n), MX_OK);
        assert!(n > 0);
        refused(
            mx_puller_param_count(p, 2, &mut n),
            MX_ERR_INVALID_ARGUMENT,
            &["rank: 2 is not one of this puller's ranks [0, 1]"],
        );
        let mut info = std::mem::zeroed::<ParamInfo>();
        assert_eq!(mx_puller_param_info(p, 0, 0, &mut info), MX_OK);
        let name = CStr::from_ptr(info.name).to_str().unwrap().to_string();
        let dtype = CStr::from_ptr(info.dtype).to_str().unwrap();
        assert_eq!(dtype, "BF16");
        refused(
            mx_puller_param_info(p, 0, n + 5, &mut info),
            MX_ERR_INVALID_ARGUMENT,
            &["index"],
        );
        let mut mem = vec![0u8; info.len as usize];
        let f32 = CString::new("F32").unwrap();
        let cname = CString::new(name.as_str()).unwrap();
        refused(
            mx_puller_register_param(
                p,
                0,
                cname.as_ptr(),
                mem.as_mut_ptr().cast(),
                info.len,
                f32.as_ptr(),
                info.shape,
                info.ndim,
            ),
            MX_ERR_INVALID_ARGUMENT,
            &[&name, "dtype"],
        );
        refused(
            mx_puller_register_param(
                p,
                0,
                cname.as_ptr(),
                mem.as_mut_ptr().cast(),
                info.len - 1,
                info.dtype,
                info.shape,
                info.ndim,
            ),
            MX_ERR_INVALID_ARGUMENT,
            &[&name],
        );
        refused(
            mx_puller_register_param(
                p,
                0,
                cname.as_ptr(),
                null_mut(),
                info.len,
                info.dtype,
                info.shape,
                info.ndim,
            ),
            MX_ERR_INVALID_ARGUMENT,
            &[&name, "NULL pointer"],
        );
        refused(
            mx_puller_register_param(
                p,
                0,
                cname.as_ptr(),
                mem.as_mut_ptr().cast(),
                u64::MAX,
                info.dtype,
                info.shape,
                info.ndim,
            ),
            MX_ERR_INVALID_ARGUMENT,
            &["too large"],
        );
        assert_eq!(
            mx_puller_register_param(
                p,
                0,
                cname.as_ptr(),
                mem.as_mut_ptr().cast(),
                info.len,
                info.dtype,
                info.shape,
                info.ndim,
            ),
            MX_OK,
            "{}",
            last_error()
        );
        refused(
            mx_puller_rollback(p),
            MX_ERR_STATE,
            &["has no destination memory registered"],
        );
        let label = CString::new("v1").unwrap();
        refused(
            mx_puller_stage(p, label.as_ptr(), null_mut()),
            MX_ERR_STATE,
            &["no control plane"],
        );
        let id = CString::new(format!("mx:{}", "0".repeat(64))).unwrap();
        let json = CString::new("[]").unwrap();
        refused(
            mx_puller_stage_manifests(p, id.as_ptr(), json.as_ptr()),
            MX_ERR_VERIFY,
            &["manifests are of version"],
        );
        let bad_json = CString::new("[{").unwrap();
        refused(
            mx_puller_stage_manifests(p, id.as_ptr(), bad_json.as_ptr()),
            MX_ERR_INVALID_ARGUMENT,
            &["manifests_json"],
        );
        let mut rep = MemoryReportC::default();
        assert_eq!(mx_puller_memory_report(p, &mut rep), MX_OK);
        assert!(rep.rank_bytes > 0 && rep.staging_bytes == 0 && rep.retained_bytes == 0);
        assert!(rep.process_rss_bytes > 0 && rep.process_rss_bytes_peak >= rep.process_rss_bytes);
        let (mut resident, mut staged) = (null_mut(), null_mut());
        assert_eq!(
            mx_puller_versions(p, &mut resident, null_mut(), &mut staged),
            MX_OK
        );
        assert!(resident.is_null() && staged.is_null());
        mx_puller_free(p);
    }
}

#[test]
fn expected_outputs_are_published_from_json_and_bad_json_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let listen = CString::new("127.0.0.1:0").unwrap();
    let journal = CString::new(dir.path().join("j.jsonl").to_str().unwrap()).unwrap();
    let (mut plane, mut url, mut c) = (null_mut(), null_mut(), null_mut());
    let m = model();
    let (v1, nope) = (CString::new("v1").unwrap(), CString::new("nope").unwrap());
    let layout = CString::new("fsdp:2").unwrap();
    let json = |s: &str| CString::new(s).unwrap();
    let good = json(
        r#"{"probes": [{"prompt_tokens": [1, 2], "tokens": [5, 6], "margins": [1.5, 0.1]}],
            "max_new_tokens": 2}"#,
    );
    unsafe {
        assert_eq!(
            mx_control_plane_start(listen.as_ptr(), journal.as_ptr(), &mut plane, &mut url),
            MX_OK,
            "{}",
            last_error()
        );
        assert_eq!(mx_control_connect(url, &mut c), MX_OK, "{}", last_error());
        assert_eq!(
            mx_control_declare(c, v1.as_ptr(), layout.as_ptr(), m),
            MX_OK,
            "{}",
            last_error()
        );
        let publish = |label: &CString, j: &CString| {
            mx_control_publish_expected_outputs(c, label.as_ptr(), j.as_ptr())
        };
        for (bad, needles) in [
            (
                r#"{"probes": [], "max_new_tokens": 2, "bogus": 1}"#,
                &["json", "bogus"][..],
            ),
            (
                r#"{"probes": [{"prompt_tokens": [1], "tokens": [5, 6], "margins": [1.5]}], "max_new_tokens": 2}"#,
                &["json.probes[0].margins", "1 values for 2 tokens"][..],
            ),
            (
                r#"{"probes": [{"prompt_tokens": [1]}], "max_new_tokens": 2, "max_new_tokens": 3}"#,
                &["duplicate field"][..],
            ),
            ("not json", &["json"][..]),
        ] {
            refused(publish(&v1, &json(bad)), MX_ERR_INVALID_ARGUMENT, needles);
        }
        refused(
            mx_control_publish_expected_outputs(c, v1.as_ptr(), null()),
            MX_ERR_INVALID_ARGUMENT,
            &["json: NULL string"],
        );
        refused(publish(&nope, &good), MX_ERR_UNKNOWN_VERSION, &["nope"]);
        assert_eq!(publish(&v1, &good), MX_OK, "{}", last_error());
        assert_eq!(
            publish(&v1, &good),
            MX_OK,
            "the same again: {}",
            last_error()
        );
        let other =
            json(r#"{"probes": [{"prompt_tokens": [1, 2], "tokens": [7]}], "max_new_tokens": 2}"#);
        refused(publish(&v1, &other), MX_ERR_CONTROL, &["already published"]);
        mx_control_free(c);
        mx_control_plane_free(plane);
        mx_string_free(url);
        mx_model_free(m);
    }
}
