//! `mx.MxError`: the one Python exception type for every failure that mx itself reports.
//!
//! Its message is the Rust error with its whole `source()` chain (`a: b: c`, each cause once),
//! and its `code` attribute is the gRPC status name (`"InvalidArgument"`, `"NotFound"`,
//! `"FailedPrecondition"`, `"DeadlineExceeded"`, `"Unavailable"`, ...) when the failure has one,
//! else `None`. Bad arguments found before anything is asked of mx are Python's own `TypeError`
//! and `ValueError`.

use pyo3::prelude::*;

pyo3::create_exception!(
    mx,
    MxError,
    pyo3::exceptions::PyException,
    "An error reported by mx (the Rust library or the control plane).\n\n\
     The message is the whole error chain; `code` is the gRPC status name (e.g.\n\
     \"InvalidArgument\", \"NotFound\", \"FailedPrecondition\", \"DeadlineExceeded\",\n\
     \"Unavailable\") when there is one, else None."
);

/// The message of `e` followed by each of its sources that the text so far does not already
/// contain (many errors print their source inside their own message).
pub(crate) fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let m = s.to_string();
        if !m.is_empty() && !msg.contains(&m) {
            msg.push_str(": ");
            msg.push_str(&m);
        }
        source = s.source();
    }
    msg
}

/// An `MxError` with `message` and `code` (a gRPC status name).
pub(crate) fn mx_error(py: Python<'_>, message: String, code: Option<&str>) -> PyErr {
    let err = MxError::new_err(message);
    if let Some(code) = code {
        // Exception instances take attributes; failing to set one must not hide the error.
        let _ = err.value(py).setattr("code", code);
    }
    err
}

/// The `MxError` for a control-plane error (its code is the one the control plane maps it to).
pub(crate) fn control_error(py: Python<'_>, e: &mx_control::Error) -> PyErr {
    mx_error(py, chain(e), Some(&format!("{:?}", e.code())))
}

/// The `MxError` for a layout error (a malformed layout, dtype, digest...).
pub(crate) fn layout_error(py: Python<'_>, what: &str, e: &mx_layout::Error) -> PyErr {
    mx_error(py, format!("{what}: {}", chain(e)), Some("InvalidArgument"))
}
