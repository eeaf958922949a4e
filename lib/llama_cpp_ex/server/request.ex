defmodule LlamaCppEx.Server.Request do
  @moduledoc false
  # Everything one request carries from admission to its end: who waits for it, how to
  # sample, what turns its tokens into text, and its timing. The KV state it uses lives in its
  # slot (`LlamaCppEx.Server.Slot`).

  alias LlamaCppEx.{Generation, Pipeline, Sampler}

  @typedoc "Whether a blocking call or a stream made the request (telemetry's `mode`)."
  @type mode :: :generate | :stream

  @enforce_keys [:tokens, :max_tokens, :sampler, :pipeline, :stream_pid, :stream_ref]
  defstruct [
    :tokens,
    :max_tokens,
    :sampler,
    :pipeline,
    :stream_pid,
    :stream_ref,
    :monitor_ref,
    mode: :stream,
    cache_prompt: true,
    session: nil,
    cache_scope: nil,
    t_start: nil,
    t_first_token: nil,
    n_prefix_cache: 0,
    # speculation: the draft length (nil: off), whether drafts come from the Server's draft
    # model (else prompt lookup), how many of its sequence's tokens the engine has (0: none
    # yet, the next speculating step starts its history over), drafts proposed and accepted
    n_draft: nil,
    draft_model?: false,
    spec_sent: 0,
    n_drafted: 0,
    n_accepted: 0
  ]

  @type t :: %__MODULE__{
          tokens: [non_neg_integer(), ...],
          max_tokens: pos_integer(),
          sampler: Sampler.t(),
          pipeline: Pipeline.t(),
          stream_pid: pid(),
          stream_ref: reference(),
          monitor_ref: reference() | nil,
          mode: mode(),
          cache_prompt: boolean(),
          session: term(),
          cache_scope: term(),
          t_start: integer() | nil,
          t_first_token: integer() | nil,
          n_prefix_cache: non_neg_integer(),
          n_draft: pos_integer() | nil,
          draft_model?: boolean(),
          spec_sent: non_neg_integer(),
          n_drafted: non_neg_integer(),
          n_accepted: non_neg_integer()
        }

  @doc """
  The request of a prepared generation whose events go to `pid` tagged with `ref`; `opts`
  holds the server options of the request (`:cache_prompt`, `:session`, `:cache_scope`,
  `:mode`).
  """
  @spec new(Generation.t(), keyword(), pid(), reference()) :: t()
  def new(%Generation{} = gen, opts, pid, ref) do
    spec = gen.speculative

    %__MODULE__{
      tokens: gen.tokens,
      max_tokens: gen.max_tokens,
      sampler: gen.sampler,
      pipeline: Pipeline.new(gen, gen.max_tokens),
      stream_pid: pid,
      stream_ref: ref,
      mode: Keyword.get(opts, :mode, :stream),
      cache_prompt: Keyword.get(opts, :cache_prompt, true),
      session: Keyword.get(opts, :session),
      cache_scope: Keyword.get(opts, :cache_scope),
      n_draft: spec && spec.n_draft,
      draft_model?: spec != nil and spec.draft_model?
    }
  end

  @doc "The session-affinity key (`{cache_scope, session}`), or `nil`."
  @spec session_key(t()) :: term()
  def session_key(%__MODULE__{session: nil}), do: nil
  def session_key(%__MODULE__{session: s, cache_scope: scope}), do: {scope, s}

  @doc "Sends events to the consumer."
  @spec deliver(t(), [Pipeline.event()]) :: :ok
  def deliver(%__MODULE__{stream_pid: pid, stream_ref: ref}, events) do
    Enum.each(events, fn event -> send(pid, {ref, event}) end)
  end
end
