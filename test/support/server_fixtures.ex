defmodule LlamaCppEx.ServerFixtures do
  @moduledoc false
  # Server requests for the pure tests of placement, plans and strategies: no model, a
  # sampler reference that is never used.

  alias LlamaCppEx.{Pipeline, Sampler}
  alias LlamaCppEx.Server.Request

  @doc "A request for `tokens`; `opts` sets any other field of `LlamaCppEx.Server.Request`."
  def request(tokens, opts \\ []) do
    struct!(
      %Request{
        tokens: tokens,
        max_tokens: 4,
        sampler: %Sampler{ref: make_ref()},
        pipeline: Pipeline.new(%{stop: nil, logprobs: false}, 4),
        stream_pid: self(),
        stream_ref: make_ref()
      },
      opts
    )
  end
end
