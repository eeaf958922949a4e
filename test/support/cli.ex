defmodule LlamaCppEx.CLI do
  @moduledoc false
  # For tests that run `mix llama_cpp_ex.server` as an OS process.

  import ExUnit.Assertions, only: [flunk: 1]

  @doc "The URL the server prints once it serves, read from its port's output."
  def await_url(port, acc \\ "") do
    receive do
      {^port, {:data, data}} ->
        acc = acc <> data

        case Regex.run(~r{at (http://\S+/v1)}, acc) do
          [_, url] -> url
          nil -> await_url(port, acc)
        end

      {^port, {:exit_status, s}} ->
        flunk("the server exited (#{s}): #{acc}")
    after
      120_000 -> flunk("no URL printed: #{acc}")
    end
  end
end
