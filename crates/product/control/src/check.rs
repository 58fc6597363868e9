//! The post-update check (phase CHECK): greedy generations every worker's engine runs after
//! APPLY, judged against the outputs expected of the target version.
//!
//! **Where expected outputs come from.** A trainer computes them with its own forward pass on
//! the weights it publishes (greedy tokens for a few probe prompts, with the log-probability
//! margin between its top two candidates at each position) and publishes them with the version
//! (`PublishExpectedOutputs`, [`crate::record::Record::ExpectedOutputs`]); every refit of that
//! version checks against them unless it brings a check of its own or asks for none. An
//! orchestrator can also give golden tokens directly (`mx refit --expect-tokens`, a
//! [`GenerationCheck`] of its own).
//!
//! **The rule: exact up to the first near-tie.** An engine's greedy tokens must equal the
//! expected ones position by position. Kernels differ (the trainer's fp32 forward against an
//! engine's bf16 one, other reduction orders), so where the two candidates the trainer weighed
//! were almost tied, an engine may legitimately take the other: the first position where the
//! tokens differ is accepted when the trainer's margin there (`log p(top1) - log p(top2)`, nats)
//! is below the check's `tie_margin` ([`DEFAULT_TIE_MARGIN`] when published without one), and
//! the tokens after it are not compared (the continuations then legitimately part). A
//! difference where the trainer's choice was clear fails the check, naming the probe, the
//! position, both tokens and the margin. Without margins (golden tokens given directly) the
//! match must be exact. Only positions both sides produced are compared: an engine may stop
//! early at an end-of-sequence token the trainer also chose, but must return at least one.

use serde::{Deserialize, Serialize};

/// The default `tie_margin` (nats): a first difference where the trainer's top two candidates
/// were closer than this is accepted. bf16 keeps 8 significant bits, so logits of magnitude
/// 10-30 carry rounding errors of 0.05-0.1 each; twice that covers an engine and a trainer
/// rounding in opposite directions, while a wrong weight moves margins by whole nats.
pub const DEFAULT_TIE_MARGIN: f32 = 0.25;

/// At most this many probes per check.
pub const MAX_PROBES: usize = 16;
/// At most this many tokens per probe prompt.
pub const MAX_PROMPT_TOKENS: usize = 4096;
/// At most this many new tokens per probe.
pub const MAX_NEW_TOKENS: u32 = 1024;
/// The largest `tie_margin` accepted (nats): beyond it almost any difference would pass.
pub const MAX_TIE_MARGIN: f32 = 5.0;

/// One probe: a prompt and the greedy continuation expected of the target version.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Probe {
    /// Prompt token ids.
    pub prompt_tokens: Vec<u32>,
    /// The expected greedy tokens (at most the check's `max_new_tokens`); empty: only require
    /// that the engine returns tokens (catches a dead or erroring engine, not wrong weights).
    #[serde(default)]
    pub tokens: Vec<u32>,
    /// Per position of `tokens`: the trainer's `log p(top1) - log p(top2)` (nats, >= 0), where
    /// near-ties are tolerated ([`judge`]); empty: the match must be exact.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub margins: Vec<f32>,
    /// Per position of `tokens`: the trainer's log-probability of that token (nats, <= 0);
    /// reported, not judged.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<f32>,
}

/// The post-update generation: greedy decoding of every probe on every worker after APPLY,
/// judged by the rule in the module docs.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct GenerationCheck {
    /// The probes (at least one).
    pub probes: Vec<Probe>,
    /// Tokens each generation decodes (>= 1).
    pub max_new_tokens: u32,
    /// Near-ties below this margin (nats) may differ once ([`judge`]).
    #[serde(default)]
    pub tie_margin: f32,
    /// Where the expected tokens come from, for messages ("published with step-3 by its
    /// trainer", "given to mx refit"); empty when unknown.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub source: String,
}

/// The journal's form of a [`GenerationCheck`]: today's, or the single-prompt one journals
/// written before probes hold (`prompt_tokens`, `expected_tokens`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckOnDisk {
    #[serde(default)]
    probes: Vec<Probe>,
    #[serde(default)]
    prompt_tokens: Vec<u32>,
    #[serde(default)]
    expected_tokens: Vec<u32>,
    max_new_tokens: u32,
    #[serde(default)]
    tie_margin: f32,
    #[serde(default)]
    source: String,
}

impl<'de> Deserialize<'de> for GenerationCheck {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let c = CheckOnDisk::deserialize(d)?;
        let single = !c.prompt_tokens.is_empty() || !c.expected_tokens.is_empty();
        if single && !c.probes.is_empty() {
            return Err(serde::de::Error::custom(
                "a check has either probes or prompt_tokens/expected_tokens, not both",
            ));
        }
        let probes = if single {
            vec![Probe {
                prompt_tokens: c.prompt_tokens,
                tokens: c.expected_tokens,
                ..Probe::default()
            }]
        } else {
            c.probes
        };
        Ok(GenerationCheck {
            probes,
            max_new_tokens: c.max_new_tokens,
            tie_margin: c.tie_margin,
            source: c.source,
        })
    }
}

impl GenerationCheck {
    /// One prompt whose `max_new_tokens` greedy tokens must equal `expected` exactly (empty:
    /// only require tokens).
    pub fn tokens(prompt_tokens: Vec<u32>, max_new_tokens: u32, expected: Vec<u32>) -> Self {
        GenerationCheck {
            probes: vec![Probe {
                prompt_tokens,
                tokens: expected,
                ..Probe::default()
            }],
            max_new_tokens,
            tie_margin: 0.0,
            source: String::new(),
        }
    }

    /// True when some probe has expected tokens (else only generation is required).
    pub fn has_expected(&self) -> bool {
        self.probes.iter().any(|p| !p.tokens.is_empty())
    }

    /// Checks the bounds and consistency of a check from outside.
    ///
    /// # Errors
    /// `(field, reason)` naming the first bad field, e.g. `probes[1].margins`.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let bad = |f: String, r: String| Err((f, r));
        if self.probes.is_empty() || self.probes.len() > MAX_PROBES {
            return bad(
                "probes".into(),
                format!("{} probes: give 1 to {MAX_PROBES}", self.probes.len()),
            );
        }
        if self.max_new_tokens == 0 || self.max_new_tokens > MAX_NEW_TOKENS {
            return bad(
                "max_new_tokens".into(),
                format!("{}: give 1 to {MAX_NEW_TOKENS}", self.max_new_tokens),
            );
        }
        if !(0.0..=MAX_TIE_MARGIN).contains(&self.tie_margin) {
            return bad(
                "tie_margin".into(),
                format!("{}: give 0 to {MAX_TIE_MARGIN} nats", self.tie_margin),
            );
        }
        crate::limits::text("source", &self.source)
            .map_err(|e| ("source".into(), e.to_string()))?;
        for (i, p) in self.probes.iter().enumerate() {
            let f = |name: &str| format!("probes[{i}].{name}");
            if p.prompt_tokens.is_empty() || p.prompt_tokens.len() > MAX_PROMPT_TOKENS {
                return bad(
                    f("prompt_tokens"),
                    format!(
                        "{} tokens: give 1 to {MAX_PROMPT_TOKENS}",
                        p.prompt_tokens.len()
                    ),
                );
            }
            if p.tokens.len() > self.max_new_tokens as usize {
                return bad(
                    f("tokens"),
                    format!(
                        "{} expected tokens for max_new_tokens {}",
                        p.tokens.len(),
                        self.max_new_tokens
                    ),
                );
            }
            for (name, v, ok) in [
                (
                    "margins",
                    &p.margins,
                    (|m: f32| m >= 0.0) as fn(f32) -> bool,
                ),
                ("logprobs", &p.logprobs, |l: f32| l <= 1e-3),
            ] {
                if !v.is_empty() && v.len() != p.tokens.len() {
                    return bad(
                        f(name),
                        format!("{} values for {} tokens", v.len(), p.tokens.len()),
                    );
                }
                if let Some((j, x)) = v
                    .iter()
                    .enumerate()
                    .find(|(_, x)| !x.is_finite() || !ok(**x))
                {
                    return bad(
                        format!("{}[{j}]", f(name)),
                        format!("{x} is not a finite {name} value"),
                    );
                }
            }
        }
        Ok(())
    }
}

/// How one probe's generation was judged.
#[derive(Debug, Clone, PartialEq)]
pub enum Judged {
    /// Every compared token equal.
    Exact,
    /// The first difference, at `position`, where the trainer's margin was below the tolerance.
    NearTie {
        /// Position in the generated tokens.
        position: usize,
        /// The trainer's margin there (nats).
        margin: f32,
    },
    /// No expected tokens: tokens came back.
    Generated,
}

/// Judges `got`, an engine's greedy tokens for `probe`, by the rule in the module docs.
///
/// # Errors
/// Why the generation fails the check: no tokens, or a difference where the trainer's choice
/// was clear (naming the position, both tokens and the margin).
pub fn judge(probe: &Probe, got: &[u32], tie_margin: f32) -> Result<Judged, String> {
    if got.is_empty() {
        return Err("the generation gave no tokens".into());
    }
    if probe.tokens.is_empty() {
        return Ok(Judged::Generated);
    }
    let Some(i) = got.iter().zip(&probe.tokens).position(|(g, e)| g != e) else {
        return Ok(Judged::Exact);
    };
    match probe.margins.get(i) {
        Some(&m) if m < tie_margin => Ok(Judged::NearTie {
            position: i,
            margin: m,
        }),
        Some(&m) => Err(format!(
            "token {i} is {} where {} was expected, and the trainer's choice there was clear (margin {m:.3} nats, tolerance {tie_margin})",
            got[i], probe.tokens[i]
        )),
        None => Err(format!(
            "token {i} is {} where {} was expected (exact match required)",
            got[i], probe.tokens[i]
        )),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // reason: tests fail loudly on purpose
mod tests {
    use super::*;

    fn probe(tokens: &[u32], margins: &[f32]) -> Probe {
        Probe {
            prompt_tokens: vec![1, 2],
            tokens: tokens.to_vec(),
            margins: margins.to_vec(),
            logprobs: Vec::new(),
        }
    }

    #[test]
    fn exact_up_to_the_first_near_tie() {
        let p = probe(&[5, 6, 7, 8], &[3.0, 0.1, 2.0, 4.0]);
        assert_eq!(judge(&p, &[5, 6, 7, 8], 0.25), Ok(Judged::Exact));
        // The first difference at a near-tie passes, and nothing after it is compared.
        assert_eq!(
            judge(&p, &[5, 9, 1, 1], 0.25),
            Ok(Judged::NearTie {
                position: 1,
                margin: 0.1
            })
        );
        // A difference where the trainer was sure fails, naming it.
        let e = judge(&p, &[5, 6, 9, 8], 0.25).unwrap_err();
        assert!(
            e.contains("token 2 is 9 where 7 was expected") && e.contains("margin 2.000"),
            "{e}"
        );
        // A tighter tolerance turns the near-tie into a failure.
        assert!(judge(&p, &[5, 9, 1, 1], 0.05).is_err());
        // An engine stopping early after equal tokens passes; no tokens never does.
        assert_eq!(judge(&p, &[5, 6], 0.25), Ok(Judged::Exact));
        assert!(judge(&p, &[], 0.25).unwrap_err().contains("no tokens"));
        // Without margins: exact.
        let golden = probe(&[5, 6], &[]);
        assert!(judge(&golden, &[5, 7], 5.0)
            .unwrap_err()
            .contains("exact match required"));
        assert_eq!(judge(&probe(&[], &[]), &[3], 0.0), Ok(Judged::Generated));
    }

    #[test]
    fn checks_are_bounded_and_consistent() {
        let ok = GenerationCheck {
            probes: vec![probe(&[5, 6], &[1.0, 0.5])],
            max_new_tokens: 2,
            tie_margin: DEFAULT_TIE_MARGIN,
            source: "published with v by its trainer".into(),
        };
        assert_eq!(ok.validate(), Ok(()));
        let field = |f: &dyn Fn(&mut GenerationCheck)| {
            let mut c = ok.clone();
            f(&mut c);
            c.validate().unwrap_err().0
        };
        assert_eq!(field(&|c| c.probes.clear()), "probes");
        assert_eq!(field(&|c| c.max_new_tokens = 1), "probes[0].tokens");
        assert_eq!(
            field(&|c| c.probes[0].margins.pop().map(drop).unwrap()),
            "probes[0].margins"
        );
        assert_eq!(
            field(&|c| c.probes[0].margins[1] = f32::NAN),
            "probes[0].margins[1]"
        );
        assert_eq!(
            field(&|c| c.probes[0].margins[0] = -1.0),
            "probes[0].margins[0]"
        );
        assert_eq!(
            field(&|c| c.probes[0].logprobs = vec![-1.0, 0.5]),
            "probes[0].logprobs[1]"
        );
        assert_eq!(
            field(&|c| c.probes[0].prompt_tokens.clear()),
            "probes[0].prompt_tokens"
        );
        assert_eq!(field(&|c| c.tie_margin = 9.0), "tie_margin");
        assert_eq!(field(&|c| c.max_new_tokens = 0), "max_new_tokens");
    }

    #[test]
    fn a_check_is_held_to_each_workers_model_limits() {
        let limits = crate::refit::ModelLimits {
            vocab_size: 100,
            max_positions: 8,
        };
        let mut c = GenerationCheck::tokens(vec![1, 2], 4, vec![]);
        c.probes.push(probe(&[], &[]));
        assert_eq!(limits.check(&c), Ok(()));
        c.probes[1].prompt_tokens = vec![1, 100];
        assert_eq!(
            limits.check(&c).unwrap_err().0,
            "check.probes[1].prompt_tokens[1]"
        );
        c.probes[1].prompt_tokens = vec![1, 2, 3, 4, 5];
        let (field, reason) = limits.check(&c).unwrap_err();
        assert_eq!(field, "check.max_new_tokens");
        assert!(
            reason.contains("5 prompt tokens of probe 1 + 4 new exceed max_position_embeddings 8"),
            "{reason}"
        );
    }

    #[test]
    fn journals_of_the_single_prompt_form_still_read() {
        let old: GenerationCheck = serde_json::from_str(
            r#"{"prompt_tokens":[1,2],"max_new_tokens":2,"expected_tokens":[3,4]}"#,
        )
        .unwrap();
        assert_eq!(old, GenerationCheck::tokens(vec![1, 2], 2, vec![3, 4]));
        let new: GenerationCheck =
            serde_json::from_str(&serde_json::to_string(&old).unwrap()).unwrap();
        assert_eq!(new, old);
        assert!(serde_json::from_str::<GenerationCheck>(
            r#"{"prompt_tokens":[1],"probes":[{"prompt_tokens":[1]}],"max_new_tokens":2}"#
        )
        .is_err());
        assert!(serde_json::from_str::<GenerationCheck>(r#"{"max_new_tokens":2,"x":1}"#).is_err());
    }
}
