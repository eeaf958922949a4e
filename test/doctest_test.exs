defmodule LlamaCppEx.DoctestTest do
  @moduledoc "The `iex>` examples of the documentation, run as tests."
  use ExUnit.Case, async: true

  doctest LlamaCppEx.Options
  doctest LlamaCppEx.Limits
  doctest LlamaCppEx.Sampler
  doctest LlamaCppEx.Thinking
  doctest LlamaCppEx.Grammar
  doctest LlamaCppEx.Server.KvPolicy
end
