defmodule LlamaCppEx.Eventually do
  @moduledoc false
  # Waits for a state another process reaches (a slot freed, a model loaded): polls `check`
  # every 10 ms, failing the test after `tries` polls. The wait is for an event, not a time.

  import ExUnit.Assertions, only: [flunk: 1]

  @spec wait_until((() -> boolean()), non_neg_integer()) :: :ok
  def wait_until(check, tries \\ 1000) do
    cond do
      check.() -> :ok
      tries == 0 -> flunk("condition not reached")
      true -> Process.sleep(10) && wait_until(check, tries - 1)
    end
  end
end
