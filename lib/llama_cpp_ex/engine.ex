defmodule LlamaCppEx.Engine do
  @moduledoc false
  # The one way into the engine's step, on both routes: a generation on a model runs its
  # steps in the calling process (`run/2`), a Server submits them to its engine thread
  # (`submit/3`). The structs cross the NIF by field name (native/nif/src/step.rs).

  alias LlamaCppEx.NIF

  defmodule Spec do
    @moduledoc false
    # A speculating sequence this step: the tokens it fed since its last speculating step
    # (every token of its cache with `reset`), the one evaluated now last, and where its
    # drafts come from.
    @enforce_keys [:seq, :tokens, :reset, :n_draft, :draft_model]
    defstruct [:seq, :tokens, :reset, :n_draft, :draft_model]

    @type t :: %__MODULE__{
            seq: non_neg_integer(),
            tokens: [non_neg_integer()],
            reset: boolean(),
            n_draft: pos_integer(),
            draft_model: boolean()
          }
  end

  defmodule Embed do
    @moduledoc false
    # An embedding text riding in the step on a sequence of its own: llama.cpp's pooling
    # number (-1 the model's own) and the normalisation.
    @enforce_keys [:seq, :pooling, :normalize]
    defstruct [:seq, :pooling, :normalize]

    @type t :: %__MODULE__{seq: non_neg_integer(), pooling: integer(), normalize: integer()}
  end

  defmodule Step do
    @moduledoc false
    # KV operations applied first, then one forward pass of `entries` (`{token, pos, seq,
    # logits?}`), sampling with the sampler of every sequence in `samplers`. The entry of a
    # sequence in `follow` feeds the token the step before sampled for it (its token is a
    # placeholder), or is left out when that token ended the generation or none came.
    defstruct ops: [],
              entries: [],
              samplers: [],
              purgeable: [],
              save_purged_max_bytes: 0,
              embeds: [],
              specs: [],
              follow: []

    @type kv_op ::
            {:trim, non_neg_integer(), non_neg_integer()}
            | {:share, non_neg_integer(), non_neg_integer(), non_neg_integer()}
            | {:clear, non_neg_integer()}
            | {:save, non_neg_integer(), non_neg_integer(), non_neg_integer(), pos_integer()}
            | {:restore, non_neg_integer(), reference(), non_neg_integer()}
            | {:set_write_tier, non_neg_integer()}

    @type t :: %__MODULE__{
            ops: [kv_op()],
            entries: [{non_neg_integer(), non_neg_integer(), non_neg_integer(), boolean()}],
            samplers: [{non_neg_integer(), reference()}],
            purgeable: [non_neg_integer()],
            save_purged_max_bytes: non_neg_integer(),
            embeds: [Embed.t()],
            specs: [Spec.t()],
            follow: [non_neg_integer()]
          }
  end

  defmodule Sampled do
    @moduledoc false
    # A token sampled for a sequence: its bytes, whether it ends generation, its
    # log-probabilities (`{logprob, [{id, piece, logprob}]}`) when asked for.
    defstruct [:seq, :token, :piece, :eog, :logprobs]

    @type t :: %__MODULE__{
            seq: non_neg_integer(),
            token: non_neg_integer(),
            piece: binary(),
            eog: boolean(),
            logprobs: {float(), [{non_neg_integer(), binary(), float()}]} | nil
          }
  end

  defmodule Outcome do
    @moduledoc false
    # What a step did (see the engine's `StepOutcome`).
    defstruct [
      :sampled,
      :purged,
      :n_splits,
      :failed,
      :embeddings,
      :eval_us,
      :draft_us,
      :kv_free_tokens,
      :kv_exclusive_tokens,
      :kv_occupancy,
      :drafted,
      :saved,
      :restore_failed
    ]

    @type snapshot :: {reference(), non_neg_integer(), non_neg_integer()}
    @type t :: %__MODULE__{
            sampled: [Sampled.t()],
            purged: [non_neg_integer()],
            n_splits: non_neg_integer(),
            failed: [non_neg_integer()],
            embeddings: [{non_neg_integer(), {:ok, binary()} | {:error, String.t()}}],
            eval_us: non_neg_integer(),
            draft_us: non_neg_integer(),
            kv_free_tokens: non_neg_integer(),
            kv_exclusive_tokens: [{non_neg_integer(), non_neg_integer()}],
            kv_occupancy: float(),
            drafted: [{non_neg_integer(), non_neg_integer()}],
            saved: [{non_neg_integer(), non_neg_integer(), snapshot()}],
            restore_failed: [non_neg_integer()]
          }
  end

  @doc "Runs `step` on the context `ctx_ref` in this process (a dirty CPU scheduler)."
  @spec run(reference(), Step.t()) :: {:ok, Outcome.t()} | {:error, term()}
  def run(ctx_ref, %Step{} = step), do: NIF.context_step(ctx_ref, step)

  @doc """
  Queues `step` on the engine thread `engine`; its outcome arrives as `{ref, {:ok,
  %Outcome{}}}` or `{ref, {:error, reason}}`.
  """
  @spec submit(reference(), reference(), Step.t()) :: :ok | {:error, term()}
  def submit(engine, ref, %Step{} = step), do: NIF.engine_submit(engine, self(), ref, step)
end
