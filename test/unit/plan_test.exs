defmodule LlamaCppEx.Server.PlanTest do
  use ExUnit.Case, async: true

  import LlamaCppEx.ServerFixtures, only: [request: 2]
  alias LlamaCppEx.Engine.{Spec, Step}
  alias LlamaCppEx.Server.{Plan, Slot}

  defp speculating(prompt, fed, pending) do
    request = request(prompt, n_draft: 4)

    %Slot{
      seq: 3,
      state: :generating,
      request: request,
      prompt: List.to_tuple(prompt),
      n_prompt: length(prompt),
      fed: fed,
      pending: pending,
      pos: length(prompt) + length(fed)
    }
  end

  test "a speculating decode sends its whole sequence once, then only what it fed since" do
    slot = speculating([1, 2, 3], [], 10)

    {%Step{specs: [spec], entries: [{10, 3, 3, true}]}, slots, _} =
      Plan.to_step([{:decode, 3}], %{3 => slot})

    assert %Spec{seq: 3, reset: true, tokens: [1, 2, 3, 10], n_draft: 4} = spec

    # the step accepted two drafts (11, 12) and sampled 13: the slot fed 10, 11, 12
    slot = %{slots[3] | fed: [12, 11, 10], pending: 13, pos: 6}
    {%Step{specs: [spec]}, slots, _} = Plan.to_step([{:decode, 3}], %{3 => slot})
    assert %Spec{reset: false, tokens: [11, 12, 13]} = spec

    # a plain step after it: only the token decoded now
    slot = %{slots[3] | pending: 14, pos: 7}
    {%Step{specs: [spec]}, _, _} = Plan.to_step([{:decode, 3}], %{3 => slot})
    assert %Spec{reset: false, tokens: [14]} = spec
  end

  test "a request that does not speculate sends no spec" do
    slot = %{
      speculating([1, 2], [], 5)
      | request: %{speculating([1], [], 5).request | n_draft: nil}
    }

    assert {%Step{specs: []}, _, %{decode: 1}} = Plan.to_step([{:decode, 3}], %{3 => slot})
  end
end
