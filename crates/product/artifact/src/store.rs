//! Where artifacts live: an `s3://bucket/prefix` URL and an S3 client configured from the
//! standard AWS environment.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path;
use object_store::{ClientOptions, ObjectStore, RetryConfig};

use crate::Error;

/// An artifact's location: `s3://<bucket>/<prefix>`, the prefix a `/`-separated key prefix under
/// which the artifact's objects live (`<prefix>/mx-artifact.json`, its safetensors files or delta
/// objects). Parsed strictly: the bucket follows S3's naming rules (3-63 characters of lowercase
/// letters, digits, `-` and `.`), the prefix has no empty, `.` or `..` segment.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ArtifactUrl {
    bucket: String,
    prefix: String,
}

impl ArtifactUrl {
    /// The bucket.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The key prefix (no leading or trailing `/`; empty for the bucket's root).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The object key of `name` under the prefix.
    pub fn key(&self, name: &str) -> Path {
        if self.prefix.is_empty() {
            Path::from(name)
        } else {
            Path::from(format!("{}/{name}", self.prefix))
        }
    }

    /// The URL of a sibling artifact under the same bucket: `prefix` replaced by `other`.
    ///
    /// # Errors
    /// [`Error::BadUrl`] when `other` is not a valid prefix.
    pub fn with_prefix(&self, other: &str) -> Result<ArtifactUrl, Error> {
        format!("s3://{}/{other}", self.bucket).parse()
    }
}

impl fmt::Display for ArtifactUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.prefix.is_empty() {
            write!(f, "s3://{}", self.bucket)
        } else {
            write!(f, "s3://{}/{}", self.bucket, self.prefix)
        }
    }
}

impl FromStr for ArtifactUrl {
    type Err = Error;

    /// Parses `s3://bucket` or `s3://bucket/prefix/...` (a trailing `/` is dropped).
    ///
    /// # Errors
    /// [`Error::BadUrl`] naming the URL and what is wrong with it.
    fn from_str(s: &str) -> Result<ArtifactUrl, Error> {
        let bad = |why: &str| Error::BadUrl {
            url: s.to_string(),
            reason: why.to_string(),
        };
        let rest = s
            .strip_prefix("s3://")
            .ok_or_else(|| bad("expected s3://BUCKET[/PREFIX]"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let bucket_ok = (3..=63).contains(&bucket.len())
            && bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            && !bucket.starts_with(['-', '.'])
            && !bucket.ends_with(['-', '.']);
        if !bucket_ok {
            return Err(bad(
                "the bucket must be 3-63 lowercase letters, digits, '-' or '.', \
                 starting and ending with a letter or digit",
            ));
        }
        let prefix = prefix.strip_suffix('/').unwrap_or(prefix);
        if !prefix.is_empty() {
            for seg in prefix.split('/') {
                if seg.is_empty() || seg == "." || seg == ".." {
                    return Err(bad("the prefix has an empty, '.' or '..' segment"));
                }
                if seg.bytes().any(|b| b.is_ascii_control()) {
                    return Err(bad("the prefix has a control character"));
                }
            }
        }
        Ok(ArtifactUrl {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
        })
    }
}

/// How patient the S3 client is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StoreOptions {
    /// Deadline of one request, connection included (default 30 s).
    pub timeout: Duration,
    /// Retries of a failed request (with backoff), after the first try (default 3).
    pub retries: usize,
    /// Requests in flight at once per read or upload (default 16).
    pub concurrency: usize,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            timeout: Duration::from_secs(30),
            retries: 3,
            concurrency: 16,
        }
    }
}

/// An S3 client for one bucket, configured from the standard AWS variables: `AWS_ENDPOINT_URL`
/// (or `AWS_ENDPOINT`), `AWS_REGION` / `AWS_DEFAULT_REGION`, `AWS_ACCESS_KEY_ID`,
/// `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, and `AWS_ALLOW_HTTP=true` for an `http://`
/// endpoint (a loopback server). Requests are path-style. Built with the `object_store` crate.
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    bucket: String,
    opts: StoreOptions,
}

impl Store {
    /// A client for `url`'s bucket from the environment.
    ///
    /// # Errors
    /// [`Error::Store`] when the environment does not configure a usable client.
    pub fn from_env(url: &ArtifactUrl, opts: StoreOptions) -> Result<Store, Error> {
        Store::from_vars(url, opts, std::env::vars())
    }

    /// As [`Store::from_env`], from the given `(name, value)` pairs instead of the process
    /// environment (names other than `AWS_*` are ignored).
    ///
    /// # Errors
    /// [`Error::Store`] when they do not configure a usable client.
    pub fn from_vars(
        url: &ArtifactUrl,
        opts: StoreOptions,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Store, Error> {
        let client = ClientOptions::new()
            .with_timeout(opts.timeout)
            .with_connect_timeout(opts.timeout);
        let retry = RetryConfig {
            max_retries: opts.retries,
            retry_timeout: opts
                .timeout
                .saturating_mul(u32::try_from(opts.retries + 1).unwrap_or(4)),
            ..RetryConfig::default()
        };
        let mut builder = AmazonS3Builder::new()
            .with_client_options(client)
            .with_retry(retry);
        for (k, v) in vars {
            if !k.starts_with("AWS_") {
                continue;
            }
            if let Ok(key) = k.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
                builder = builder.with_config(key, v);
            }
        }
        let s3 = builder
            .with_bucket_name(url.bucket())
            .build()
            .map_err(|e| Error::Store {
                url: url.to_string(),
                op: "configuring the S3 client from the AWS_* environment",
                source: Box::new(e),
            })?;
        Ok(Store {
            inner: Arc::new(s3),
            bucket: url.bucket().to_string(),
            opts,
        })
    }

    /// A store over any [`ObjectStore`] (tests, other clouds).
    pub fn new(inner: Arc<dyn ObjectStore>, bucket: &str, opts: StoreOptions) -> Store {
        Store {
            inner,
            bucket: bucket.to_string(),
            opts,
        }
    }

    /// The client.
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    /// The bucket this client serves.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The options it was made with.
    pub fn options(&self) -> StoreOptions {
        self.opts
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: panics are failures
mod tests {
    use super::*;

    #[test]
    fn urls_parse_strictly() {
        let u: ArtifactUrl = "s3://mx-runs/policy/step-2/".parse().unwrap();
        assert_eq!(u.bucket(), "mx-runs");
        assert_eq!(u.prefix(), "policy/step-2");
        assert_eq!(u.to_string(), "s3://mx-runs/policy/step-2");
        assert_eq!(
            u.key("mx-artifact.json").as_ref(),
            "policy/step-2/mx-artifact.json"
        );
        let root: ArtifactUrl = "s3://bkt".parse().unwrap();
        assert_eq!(root.key("a").as_ref(), "a");
        for bad in [
            "http://b/x",
            "s3://",
            "s3://ab/x",
            "s3://Upper/x",
            "s3://-bkt/x",
            "s3://bkt/a//b",
            "s3://bkt/a/../b",
            "s3://bkt/./b",
        ] {
            let e = bad.parse::<ArtifactUrl>().unwrap_err();
            assert!(e.to_string().contains(bad), "{e}");
        }
    }
}
