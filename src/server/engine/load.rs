//! What the engine thread loads before it serves, and the decoder it opens
//! on it. [`Loaded`] is the read-only part: the model, its chat template,
//! the draft model of `--speculate`, and how users' text is read. It never
//! changes while the server runs; the decoder (the part that steps) borrows
//! its weights, and the HTTP side prepares prompts from it through a
//! [`Prompter`]. Keeping the two apart is what lets each loop own its
//! decoder outright.

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use kiln_core::{ChatTemplate, Model};

use crate::backends::ModelArgs;
use crate::server::prompt::Prompter;
use crate::speculation::SpeculationArgs;

use super::{Decoder, Speculative};

/// The model as loaded: read, never changed, while the server runs.
pub struct Loaded {
    model: Model,
    /// `None` for a model without one: it serves text completions only.
    template: Option<Arc<ChatTemplate>>,
    /// The draft model of `--speculate draft|self`.
    draft: Option<Model>,
    /// `--user-content-as-text`: special tokens users type stay text.
    user_content_as_text: bool,
}

impl Loaded {
    /// Loads the model `--model` names, its chat template (kiln's ChatML for
    /// the embedded model; the folder's or GGUF file's own, if any,
    /// otherwise) and the draft model `speculation` asks for.
    pub fn load(
        args: &ModelArgs,
        speculation: &SpeculationArgs,
        user_content_as_text: bool,
    ) -> Result<Loaded> {
        let (model, template) = load_model(args.model.as_deref())?;
        let draft = speculation.draft_model(&model)?;
        Ok(Loaded {
            model,
            template: template.map(Arc::new),
            draft,
            user_content_as_text,
        })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The decoder of `--backend`: speculative with `--speculate` (one
    /// request at a time), else IREE with `slots` > 1 batches and the rest
    /// (the ranks of `--tensor-parallel` too) run one request at a time.
    /// Every module is loaded (or compiled) here, before the server says it
    /// is ready.
    pub fn open_decoder(
        &self,
        args: &ModelArgs,
        speculation: &SpeculationArgs,
        slots: usize,
    ) -> Result<Decoder<'_>> {
        use crate::backends::open_loaded;
        let model = &self.model;
        let backend_kind = args.choose(model)?;
        if let Some(kind) = speculation.speculate {
            let draft_tokens = usize::from(speculation.draft_tokens);
            let backend = open_loaded(model, backend_kind, &args.options, Some(draft_tokens))?;
            let proposer = crate::speculation::proposer_on(kind, self.draft.as_ref(), |draft| {
                open_loaded(draft, backend_kind, &args.options, Some(draft_tokens))
            })?;
            return Ok(Decoder::Speculative(Box::new(Speculative {
                backend,
                proposer,
                draft_tokens,
            })));
        }
        // The ranks of --tensor-parallel step one sequence (the server
        // gives them one slot).
        #[cfg(feature = "xla-iree")]
        if slots > 1
            && args.options.tensor_parallel.is_none()
            && matches!(
                backend_kind,
                crate::backends::BackendKind::IreeCpu | crate::backends::BackendKind::IreeCuda
            )
        {
            let backend = crate::backends::open_iree(model, backend_kind, &args.options)?;
            let mut decoder = kiln_xla::BatchedDecoder::new(backend, slots)?;
            decoder.prepare(|_, _| {})?;
            return Ok(Decoder::Batched(Box::new(decoder)));
        }
        // Batching needs the IREE backends; without them every slot count
        // runs one request at a time.
        #[cfg(not(feature = "xla-iree"))]
        let _ = slots;
        Ok(Decoder::Single(open_loaded(
            model,
            backend_kind,
            &args.options,
            None,
        )?))
    }

    /// How the HTTP side prepares prompts for this model: against
    /// `max_context`, the decoder's context.
    pub fn prompter(&self, max_context: usize) -> Prompter {
        Prompter::new(
            &self.model,
            self.template.clone(),
            self.user_content_as_text,
            max_context,
        )
    }
}

/// The model `spec` names and its chat template.
fn load_model(spec: Option<&Path>) -> Result<(Model, Option<ChatTemplate>)> {
    match spec {
        None => Ok((
            crate::backends::load_model(None)?,
            Some(ChatTemplate::chatml()),
        )),
        Some(spec) => crate::chat::load_with_template(spec),
    }
}
