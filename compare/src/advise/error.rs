//! What the advisor refuses, and why: one error type for the cluster it is given, the model it
//! predicts and the configurations it prices.

/// Why `advise` (or a caller of its predictor) cannot go on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AdviseError {
    /// A cluster SPEC string that does not parse: the string, then what is wrong with it.
    #[error(
        "--cluster {spec}: {why} (expected HOSTSxPERHOST:RATE[,LATENCY][:INTRA[,RATE][,LATENCY]], \
         e.g. 8x8:100gbit:nvlink or 4x1:10gbit,20us; or a TOML file)"
    )]
    Spec {
        /// The SPEC as given.
        spec: String,
        /// What is wrong with it.
        why: String,
    },
    /// A cluster TOML file that cannot be read, does not parse, or holds a bad field.
    #[error("--cluster {path}: {why}")]
    File {
        /// The file.
        path: String,
        /// What is wrong with it.
        why: String,
    },
    /// A model the predictor cannot take.
    #[error("--model {model}: {why}")]
    Model {
        /// The model as named.
        model: String,
        /// Why it cannot be predicted.
        why: String,
    },
    /// A configuration or an input of the predictor that does not make sense.
    #[error("{what}: {why}")]
    Invalid {
        /// What was given (a configuration's label, a flag).
        what: String,
        /// Why it is refused.
        why: String,
    },
}

impl AdviseError {
    /// An [`AdviseError::Invalid`].
    pub fn invalid(what: impl Into<String>, why: impl Into<String>) -> Self {
        AdviseError::Invalid { what: what.into(), why: why.into() }
    }
}
