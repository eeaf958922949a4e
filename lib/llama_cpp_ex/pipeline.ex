defmodule LlamaCppEx.Pipeline do
  @moduledoc false
  # What happens to each sampled token before anyone sees it, on every route (a model's
  # local generation and every Server request): end-of-generation ends the request, the
  # log-probabilities are reported when asked for, the piece's bytes are held back until they
  # complete a UTF-8 character, and text that may become a stop string is held back until it
  # can no longer match (a match ends the request; the stop string is never emitted).
  #
  # Events, in order, are those the Server sends as `{ref, event}`:
  #   {:token, text}                 text to show (never empty, never splits a character)
  #   {:logprob, {piece, logprobs}}  one per generated token, when log-probabilities were asked
  #   {:done, :eog | :max_tokens | :stop}
  #   {:error, reason}

  alias LlamaCppEx.{StopMatcher, UTF8Stream}

  defstruct utf8: "", stop: nil, logprobs: false, generated: 0, max_tokens: nil

  @type event ::
          {:token, binary()}
          | {:logprob, {binary(), term()}}
          | {:done, :eog | :max_tokens | :stop}
          | {:error, term()}

  @type t :: %__MODULE__{
          utf8: binary(),
          stop: StopMatcher.t() | nil,
          logprobs: boolean(),
          generated: non_neg_integer(),
          max_tokens: pos_integer() | nil
        }

  @doc """
  A pipeline for a request's stop strings and log-probability flag (a prepared
  `LlamaCppEx.Generation`, or a map of those two keys), ending after `max_tokens` tokens
  (`nil`: no bound).
  """
  @spec new(%{stop: String.t() | [String.t()] | nil, logprobs: boolean()}, pos_integer() | nil) ::
          t()
  def new(%{stop: stop, logprobs: logprobs}, max_tokens) do
    %__MODULE__{stop: StopMatcher.new(stop), logprobs: logprobs, max_tokens: max_tokens}
  end

  @doc """
  Feeds one sampled token: its piece, whether it ends generation, its log-probabilities (or
  `nil`). `{:cont, events, p}` or, when it ended the request, `{:done, events, p}` (the last
  event is `{:done, reason}`).
  """
  @spec push(t(), binary(), boolean(), term()) :: {:cont | :done, [event()], t()}
  def push(p, _piece, true, _logprobs) do
    p = %{p | generated: p.generated + 1}
    {:done, finish_events(p, :eog), p}
  end

  def push(p, piece, false, logprobs) do
    p = %{p | generated: p.generated + 1}
    lp = if p.logprobs and logprobs != nil, do: [{:logprob, {piece, logprobs}}], else: []
    {text, utf8} = UTF8Stream.push(p.utf8, piece)
    p = %{p | utf8: utf8}

    case stop_push(p.stop, text) do
      {:cont, text, stop} ->
        p = %{p | stop: stop}

        if p.max_tokens != nil and p.generated >= p.max_tokens do
          {:done, lp ++ text(text) ++ finish_events(p, :max_tokens), p}
        else
          {:cont, lp ++ text(text), p}
        end

      {:stop, text} ->
        {:done, lp ++ text(text) ++ [{:done, :stop}], %{p | stop: nil, utf8: ""}}
    end
  end

  @doc "Ends the request for `reason` (held text is released first)."
  @spec finish(t(), :eog | :max_tokens | :stop) :: [event()]
  def finish(p, reason), do: finish_events(p, reason)

  @doc "Ends the request with an error (held text is released first)."
  @spec fail(t(), term()) :: [event()]
  def fail(p, reason), do: held(p) ++ [{:error, reason}]

  defp finish_events(p, reason), do: held(p) ++ [{:done, reason}]

  defp held(p) do
    held = if p.stop, do: StopMatcher.flush(p.stop), else: ""
    text(held <> p.utf8)
  end

  defp stop_push(nil, text), do: {:cont, text, nil}
  defp stop_push(matcher, text), do: StopMatcher.push(matcher, text)

  defp text(""), do: []
  defp text(t), do: [{:token, t}]
end
